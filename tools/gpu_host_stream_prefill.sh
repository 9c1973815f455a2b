#!/usr/bin/env bash
# Prefill through the GPU on the GPU host, in one go: build in place, the CUDA tests of
# gpu_service/experts/stream_prefill (dequantization, pinned staging, side-stream copies), the e2e tests
# with a real worker on the CUDA path (they make tiny checkpoints with the host's transformers),
# and bench_stream_prefill.py at Qwen3-30B-A3B and DeepSeek-V3 shapes beside the CPU kernel.
# Logs go to $OUT (or ./gpu-host-out). Wheels in .whl/ are installed first (no network there).
#   usage: bash tools/gpu_host_stream_prefill.sh [KERNEL_THREADS]
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
threads="${1:-15}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h /dev/shm | tail -1
build_in_place || exit 1
python3 -m pytest -q -p no:cacheprovider -rs tests/gpu_service/experts/stream_prefill 2>&1 \
  | tee "$out/stream-prefill-unit.log" | tail -6
KTSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -s tests/e2e/test_stream_prefill.py \
  -k "deepseek_v3 and int4 or splits" 2>&1 | tee "$out/stream-prefill-e2e.log" \
  | grep -E "relative error|passed|failed|Error" | tail -20
python3 bench/bench_stream_prefill.py --shapes qwen3,deepseek --formats int4 \
  --tokens 512,2048,8192 --layers 4 --worker-threads "$threads" 2>&1 | tee "$out/bench-stream-prefill.log"
