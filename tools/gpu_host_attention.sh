#!/usr/bin/env bash
# Issue 14's attention at scale on the GPU host, in one self-contained call (no build needed:
# the attention is torch and Triton; carry .whl for the packages the tests import):
#   tests: the attention kernels, MLA's expanded prefill and the torch reference, on CUDA
#   bench: bench_attention (decode as CUDA-graph replays and eagerly, prefill per 1k chunk, at
#          DeepSeek-V3 MLA and Qwen3-30B-A3B GQA shapes, batch 1 and 16, 4k / 32k / 128k; the
#          decode launch-shape sweep at 32k), then bench_mla_prefill at DeepSeek-V3 shapes
#          (absorbed against expanded, 1k chunks at 4k and 32k)
#   mla: the Hopper MLA decode kernel's CUDA tests, then MLA decode on it beside the Triton
#        split kernel (both a row each; 16-token blocks as the server's; the 32k sweep of both),
#        then one launch of each at batch 1 and 32k under Nsight Compute; with BASE (a tar of
#        another commit's sources) that tree's bench and this one's, twice in turn
#   flashmla: FlashMLA (the sgl-flash-mla wheel carried in .whl/) loaded or why not, its CUDA
#        tests and the Hopper kernel's, then MLA decode on both a row each at DeepSeek-V3 shapes
#        (64-token blocks, FlashMLA's page; batch 1 and 16, 4k / 32k / 128k; inside a graph of 8
#        layers too)
# Logs go to $OUT (or ./gpu-host-out).
#   usage: bash tools/gpu_host_attention.sh [tests|bench|mla|flashmla|all]
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
what="${1:-all}"
say() { echo "[$(date +%H:%M:%S)] $*"; }
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  cuda_tests "$out/tests-attention.log" 240 tests/gpu_service/attention/test_attention_triton.py \
    tests/gpu_service/attention/test_mla_prefill.py tests/gpu_service/attention/test_paged_attention.py \
    tests/gpu_service/attention/test_mla_decode_hopper.py || rc=1
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
  cuda_tests "$out/tests-mla-hopper.log" 240 tests/gpu_service/attention/test_mla_decode_hopper.py || rc=1
  say tests
  mla_bench() {  # TREE NAME: MLA decode's kernels from that tree, the 32k sweep among them
    (cd "$1" && PYTHONPATH="$1:$PYTHONPATH" timeout 200 python3 bench/bench_attention.py \
      --shapes DeepSeek --no-prefill --block-size 16 --mla-kernels triton,hopper,hopper+bf16 --layers 8 --sweep \
      --tiles "64,64,8,2;64,32,8,3;64,32,8,4") > "$out/bench-mla-decode-$2.log" 2>&1 || rc=1
    grep -v -E "^\s*$" "$out/bench-mla-decode-$2.log" | tail -40
    say "mla-decode $2"
  }
  if [ -n "${BASE:-}" ]; then  # a tar of another commit's sources: its kernels, in turn with these
    rm -rf /tmp/attn-base && mkdir -p /tmp/attn-base && tar -xf "$BASE" -C /tmp/attn-base || rc=1
    for round in 1 2; do mla_bench /tmp/attn-base "base-$round"; mla_bench "$PWD" "this-$round"; done
  else
    mla_bench "$PWD" this
  fi
  # where each kernel's time goes at batch 1, 32k: one launch of each split kernel under Nsight
  # Compute (tensor pipe, memory, warp stalls); the merge kernel is not profiled
  for kernel in triton:_decode_split_kernel hopper:_mla_split_kernel; do
    timeout 150 ncu --clock-control none -k "${kernel#*:}" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 bench/bench_attention.py \
      --shapes DeepSeek --no-prefill --block-size 16 --contexts 32768 --batches 1 --reps 3 \
      --mla-kernels "${kernel%%:*}" > "$out/ncu-${kernel%%:*}.log" 2>&1 || rc=1
    grep -E "split_kernel|Throughput|Pipe|Duration|Registers|Warp Cycles|Achieved" \
      "$out/ncu-${kernel%%:*}.log" | head -24
    grep -E "issue_stalled" "$out/ncu-${kernel%%:*}.log" | sort -k3 -n -r | head -8
  done
  say ncu
fi
if [ "$what" = flashmla ]; then
  python3 -c "from gpu_service.models import mla_decode_flashmla as f; import torch
print('FlashMLA:', f.library() and f.library().__version__, f.unavailable_reason() or 'loads',
      'on', torch.cuda.get_device_name())" 2>&1 | tail -3
  cuda_tests "$out/tests-flashmla.log" 300 tests/gpu_service/attention/test_mla_decode_flashmla.py \
    tests/gpu_service/attention/test_mla_decode_hopper.py || rc=1
  grep -q "needs a Hopper GPU with sgl-flash-mla" "$out/tests-flashmla.log" &&
    { echo "FAILED: FlashMLA's tests skipped"; rc=1; }
  say tests
  timeout 300 python3 bench/bench_attention.py --shapes DeepSeek --no-prefill --block-size 64 \
    --mla-kernels hopper,flashmla --layers 8 > "$out/bench-flashmla.log" 2>&1 || rc=1
  grep -v -E "^\s*$" "$out/bench-flashmla.log" | tail -24
  say flashmla
fi
exit $rc
