#!/usr/bin/env bash
# Every CUDA test of the suite on the GPU host (CI has no GPU): each test file with a CUDA path
# (one that names cuda, KTSERVE_TEST_DEVICE or its helpers, or takes the `device` fixture), run
# with KTSERVE_TEST_DEVICE=cuda. Fails where a test fails, or skips for want of CUDA or of a
# package this script was meant to have (carry .whl: posix_ipc, grpcio, grpcio-tools, protobuf,
# grpcio-health-checking, llguidance, fastapi, uvicorn, jsonschema, openai, openai-agents and
# their needs, sgl-flash-mla, and pytest-xdist with execnet; see gpu_host_env.sh). With
# pytest-xdist the files run in WORKERS processes (default 6; 0: one process) under one seed;
# without it one part per call fits the call's 600 s (tests/gpu_service alone took over 540 s in
# one process on an H100 host, 2026-12-07):
#   kernels  tests/gpu_service: attention, MLA, fused ops, weight formats, streamed prefill
#   steps    tests/gpu_service: decode graphs, the device's expert calls, engine, sampling, ...
#   serve    tests/gpu_service: the serve command, services and workers as processes
#   rest     tests/e2e, tests/bench, tests/tools, tests/ktserve, tests/expert_service and the rest
#   all      every part, one after the other
# The summary lines (pytest's, per part, with the commit) go to $OUT/cuda-tests-summary.txt.
#   usage: bash tools/gpu_host_cuda_tests.sh [kernels|steps|serve|rest|all] [pytest arguments]
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
part="${1:-all}"
shift || true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')"
[ -n "${BUILT:-}" ] || build_in_place || exit 1  # BUILT=1: the caller built this tree

files=$( (grep -rlE "cuda|TEST_DEVICE|worker_services|support\.devices" tests --include='test_*.py'
          grep -rlE "def test_[a-z_0-9]*\([^)]*\bdevice\b" tests --include='test_*.py') | sort -u)
kernels='attention|mla_|fused_ops|weight_only|gpu_weights|paged_attention|stream_prefill|device_kernels'
serve='serve_cli|service_heap|parallel|auto_weight_format|api'
gpu=$(echo "$files" | grep '^tests/gpu_service/')
case "$part" in
  kernels) files=$(echo "$gpu" | grep -E "$kernels") ;;
  serve) files=$(echo "$gpu" | grep -E "$serve") ;;
  steps) files=$(echo "$gpu" | grep -v -E "$kernels|$serve") ;;
  rest) files=$(echo "$files" | grep -v '^tests/gpu_service/') ;;
  all) ;;
  *) echo "usage: gpu_host_cuda_tests.sh [kernels|steps|serve|rest|all]"; exit 2 ;;
esac
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
log="$out/cuda-tests-$part.log"
parallel=()
if python3 -c "import xdist" 2>/dev/null && [ "${WORKERS:-6}" != 0 ]; then
  parallel=(-n "${WORKERS:-6}")
  export KTSERVE_TEST_SEED="${KTSERVE_TEST_SEED:-$RANDOM$RANDOM}"  # one seed for every process
fi
echo "$(echo "$files" | wc -l) test files, part $part, at $commit ${parallel[*]}"
KTSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rs "${parallel[@]}" $files "$@" \
  > "$log" 2>&1
rc=$?
tail -25 "$log"
summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1)
# a skip for want of CUDA, or of a package the host should have had: the run did not test it
missing=$(grep -E "^SKIPPED" "$log" | grep -iE "CUDA|no GPU|not installed|No module named" || true)
{
  echo "$(date -u +%FT%TZ) commit $commit part $part: $summary (rc $rc)"
  [ -n "$missing" ] && echo "$missing"
} | tee -a "$out/cuda-tests-summary.txt"
if [ -n "$missing" ]; then
  echo "FAILED: tests skipped for want of CUDA or of a package"
  rc=1
fi
exit $rc
