#!/usr/bin/env bash
# Issue 14's attention at scale on the GPU host, in one self-contained call (no build needed:
# the attention is torch and Triton; carry .whl for the packages the tests import):
#   tests: the attention kernels, MLA's expanded prefill and the torch reference, on CUDA
#   bench: bench_attention (decode as CUDA-graph replays and eagerly, prefill per 1k chunk, at
#          DeepSeek-V3 MLA and Qwen3-30B-A3B GQA shapes, batch 1 and 16, 4k / 32k / 128k; the
#          decode launch-shape sweep at 32k), then bench_mla_prefill at DeepSeek-V3 shapes
#          (absorbed against expanded, 1k chunks at 4k and 32k)
#   mla: the Hopper MLA decode kernel's CUDA tests, then MLA decode on it beside the Triton
#        split kernel (both a row each; 16-token blocks as the server's; the 32k sweep of both)
# Logs go to $OUT (or ./gpu-host-out).
#   usage: bash bench/gpu_host_attention.sh [tests|bench|mla|all]
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
what="${1:-all}"
say() { echo "[$(date +%H:%M:%S)] $*"; }
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  cuda_tests "$out/tests-attention.log" 240 tests/gpu_service/test_attention_triton.py \
    tests/gpu_service/test_mla_prefill.py tests/gpu_service/test_paged_attention.py \
    tests/gpu_service/test_mla_decode_hopper.py || rc=1
  say tests
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 150 python3 bench/bench_mla_prefill.py --device cuda --shape deepseek-v3 \
    --contexts 4096,32768 --chunks 256,1024 --reps 5 > "$out/bench-mla-prefill.log" 2>&1 || rc=1
  tail -6 "$out/bench-mla-prefill.log"
  say mla-prefill
  timeout 330 python3 bench/bench_attention.py --sweep > "$out/bench-attention.log" 2>&1 || rc=1
  grep -v -E "^\s*$" "$out/bench-attention.log" | tail -60
  say attention
fi
if [ "$what" = mla ]; then
  cuda_tests "$out/tests-mla-hopper.log" 240 tests/gpu_service/test_mla_decode_hopper.py || rc=1
  say tests
  timeout 330 python3 bench/bench_attention.py --shapes DeepSeek --no-prefill --block-size 16 \
    --mla-kernels triton,hopper,hopper+bf16 --layers 8 --sweep \
    --tiles "64,64,8,2;64,32,8,3;64,32,8,4" > "$out/bench-mla-decode.log" 2>&1 || rc=1
  grep -v -E "^\s*$" "$out/bench-mla-decode.log" | tail -60
  say mla-decode
fi
exit $rc
