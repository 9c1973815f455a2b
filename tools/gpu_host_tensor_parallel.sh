#!/usr/bin/env bash
# --tensor-parallel-size on the GPU host: the tensor-parallel tests with the GPU part on CUDA
# (NCCL, 2 GPUs; NVLink multicast off, as the leader sets for its followers), then the speed per
# size against one GPU (decode batch 16, prefill 8,192). Logs go to $OUT (or ./gpu-host-out).
#   usage: bash tools/gpu_host_tensor_parallel.sh [tests|bench|all] [MODEL_DIR] [SIZES]
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
model="${2:-demo_model}"
sizes="${3:-1,2,4,8}"
out="${OUT:-gpu-host-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 setup.py -q build_py build_ext --inplace > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
if [ "$what" = tests ] || [ "$what" = all ]; then
  KTSERVE_TEST_DEVICE=cuda python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/e2e/test_tensor_parallel.py 2>&1 | tee "$out/tests-tp-cuda.log" | grep -E \
    "TP=2|greedy|passed|failed|skipped|Error" | grep -v -E "Loading|Writing"
  python3 -m pytest -q -p no:cacheprovider tests/gpu_service/layers/test_parallel.py 2>&1 \
    | tee "$out/tests-tp-cpu.log" | tail -3
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/bench_tensor_parallel.py --model "$model" --sizes "$sizes" --batch 16 \
    --prefill 8192 --format int8 --threads 8 2>&1 | tee "$out/bench-tp.log" \
    | grep -A20 "^tensor parallelism:"
fi
