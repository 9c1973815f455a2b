#!/usr/bin/env bash
# Prefill through the GPU on the GPU host, in one go: build in place, the CUDA tests of
# gpu_service/stream_prefill (dequantization, pinned staging, side-stream copies), the e2e tests
# with a real worker on the CUDA path (they make tiny checkpoints with the host's transformers),
# and bench_stream_prefill.py at Qwen3-30B-A3B and DeepSeek-V3 shapes beside the CPU kernel.
# Logs go to $OUT (or ./gpu-host-out). Wheels in .whl/ are installed first (no network there).
#   usage: bash bench/gpu_host_stream_prefill.sh [KERNEL_THREADS]
set -uo pipefail
cd "$(dirname "$0")/.."
threads="${1:-15}"
out="${OUT:-gpu-host-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h /dev/shm | tail -1
python3 setup.py -q build_py build_ext --inplace > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider -rs tests/gpu_service/stream_prefill 2>&1 \
  | tee "$out/stream-prefill-unit.log" | tail -6
KTSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -s tests/e2e/test_stream_prefill.py \
  -k "deepseek_v3 and int4 or splits" 2>&1 | tee "$out/stream-prefill-e2e.log" \
  | grep -E "relative error|passed|failed|Error" | tail -20
python3 bench/bench_stream_prefill.py --shapes qwen3,deepseek --formats int4 \
  --tokens 512,2048,8192 --layers 4 --worker-threads "$threads" 2>&1 | tee "$out/bench-stream-prefill.log"
