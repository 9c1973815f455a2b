#!/usr/bin/env bash
# Mixed steps and first-use compiles on the GPU host, in one self-contained call (the host starts
# bare every call; carry .whl, see gpu_host_env.sh):
#   1. the Triton kernels on CUDA: tests/gpu_service/attention/test_attention_triton.py (each kernel
#      compiled once over four mixes of sequences), test_device_calls.py, test_gpu_weights.py
#   2. bench_mixed_step.py on the demo model, then on 16 Qwen3-30B-A3B layers of synthetic int4
#      experts (bench/real_checkpoint.py --experts synthetic: no experts on disk): a 2,000-token
#      prompt joining 8 decodes, the time bound off and at x3, one unrecorded warm-up repeat
#   3. bench_prefix_cache.py on the same Qwen3 checkpoint (issue 16's replay at real shapes)
# Logs go to $OUT (or ./gpu-host-out).
#   usage: bash tools/gpu_host_mixed.sh [tests|mixed|prefix|all]   (REPEATS in the environment)
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
what="${1:?usage: gpu_host_mixed.sh tests|mixed|prefix|all (all runs past one call: 10 minutes)}"
repeats="${REPEATS:-3}"
ckpt=/tmp/ktserve-mixed/q16
say() { echo "[$(date +%H:%M:%S)] $*"; }
build_in_place || exit 1
say built
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  cuda_tests "$out/tests-cuda.log" 300 tests/gpu_service/attention/test_attention_triton.py \
    tests/gpu_service/experts/test_device_calls.py tests/gpu_service/layers/test_gpu_weights.py || rc=1
fi
if [ "$what" != tests ]; then
  timeout 100 python3 bench/real_checkpoint.py "$ckpt" --shape qwen3 --layers 16 \
    --experts synthetic | tail -1
fi
if [ "$what" = mixed ] || [ "$what" = all ]; then
  timeout 240 python3 bench/bench_mixed_step.py --device cuda --threads 8 \
    --max-decode-stall-ms none,50 --repeats "$repeats" > "$out/mixed-demo.log" 2>&1 || rc=1
  grep -v -E "INFO|^\s*$" "$out/mixed-demo.log" | tail -4
  timeout 300 python3 bench/bench_mixed_step.py --model "$ckpt" --format int4 --threads 15 \
    --torch-threads 1 --device cuda --max-decode-stall-ms none,50 --repeats "$repeats" \
    > "$out/mixed-q16.log" 2>&1 || rc=1
  grep -v -E "INFO|^\s*$" "$out/mixed-q16.log" | tail -4
fi
if [ "$what" = prefix ] || [ "$what" = all ]; then
  timeout 240 python3 bench/bench_prefix_cache.py --model "$ckpt" --format int4 --threads 15 \
    --torch-threads 1 --device cuda --repeats 2 > "$out/prefix-q16.log" 2>&1 || rc=1
  grep -v -E "INFO|Token indices|^\s*$" "$out/prefix-q16.log" | tail -10
fi
say done
exit $rc
