# Sourced by tools/gpu_host_*.sh: the GPU host starts bare every call and has no network, so
# each script installs the wheels carried in .whl/ (posix_ipc, grpcio, ...) into /tmp/site and
# puts this tree and them on PYTHONPATH; $out is where logs go ($OUT, or ./gpu-host-out).
#   usage (at the top of a script): source "$(dirname "$0")/gpu_host_env.sh" || exit 1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
out="${OUT:-gpu-host-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# the extensions built in place, the log in $1 (default $out/build.log)
build_in_place() {
  local log="${1:-$out/build.log}"
  python3 setup.py -q build_py build_ext --inplace > "$log" 2>&1 || { tail -30 "$log"; return 1; }
}
# a baseline tree (a tar of another commit's sources) unpacked into $2 and built in place there,
# the log in $3: build_tree TAR DIR LOG; says why and fails where it does not build
build_tree() {
  local tar="$1" dir="$2" log="$3"
  rm -rf "$dir" && mkdir -p "$dir" && tar -xf "$tar" -C "$dir" &&
    (cd "$dir" && python3 setup.py -q build_py build_ext --inplace > "$log" 2>&1) ||
    { tail -20 "$log"; echo "FAILED: the baseline tree $tar does not build"; return 1; }
}
# pytest on CUDA (KTSERVE_TEST_DEVICE=cuda): cuda_tests LOG SECONDS TEST_FILE...; the log's tail
# printed; fails where the run failed or a test skipped for want of CUDA
cuda_tests() {
  local log="$1" limit="$2" rc=0
  shift 2
  KTSERVE_TEST_DEVICE=cuda timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rs "$@" \
    > "$log" 2>&1 || rc=1
  tail -15 "$log"
  if grep -q "CUDA is not available" "$log"; then
    echo "FAILED: tests skipped for want of CUDA"; rc=1
  fi
  return $rc
}
