#!/usr/bin/env bash
# The GPU host's checks, in one go: build in place, the CPU-side tests on every instruction set
# the host has (AVX-512, AMX), the two-process parity tests on the CUDA path, and the benchmarks.
# Logs go to $OUT (or ./gpu-host-out). Wheels in .whl/ (posix_ipc, ...) are installed first:
# the GPU host has no network.
#   usage: bash bench/gpu_host_check.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-gpu-host-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nproc; lscpu | grep -E 'Model name|Flags' | sed 's/Flags:.*\(amx[a-z_0-9 ]*\).*/AMX flags: \1/'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 setup.py -q build_py build_ext --inplace > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
python3 -c "from expert_service.kernels import available_isas; print('kernel ISAs:', available_isas())"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider tests/expert_service/test_kernels.py tests/ktshm \
    2>&1 | tee "$out/tests-cpu.log" | tail -5
  KTSERVE_TEST_DEVICE=cuda python3 -m pytest -q -s -p no:cacheprovider tests/e2e/test_parity.py \
    2>&1 | tee "$out/tests-e2e-cuda.log" | grep -E "error|passed|failed" | tail -30
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/bench_ktshm.py --iters 5000 2>&1 | tee "$out/bench-ktshm.log"
  python3 bench/bench_moe_kernel.py --threads 15 2>&1 | tee "$out/bench-kernel.log"
fi
