#!/usr/bin/env bash
# Issue 13's measurement on the GPU host, each part self-contained (a machine does not stay warm
# between calls: every part writes its own checkpoint and builds what it needs):
#   llama16   16 Qwen3-30B-A3B layers (bf16 experts): ktserve int4 (MODES) and, after it, llama.cpp
#             Q4_0 on the same checkpoint (built from .peer/llama-src.tar.gz, see
#             ../shared/peers/llamacpp/README.md; ~220 s of build, not timed), one table;
#             llama.cpp runs in a bench process of its own (--resume), as on 2026-12-01 (run
#             by the process that had run ktserve's modes, on 2026-12-02, it was half as fast);
#             ~10 minutes in all: within one 600 s call with two MODES (stream-off,stream-auto)
#   q16       the same 16 layers, ktserve's MODES alone (no llama.cpp; BATCH, PREFILL: 1,4,16
#             and none), after the CUDA tests of the chained decode steps: ~4 minutes
#   qwen48    all 48 layers (FP8 experts; bf16 would not fit the disk): ktserve int4 (MODES);
#             with LAYERS=16,48 decode only (BATCH, default 1,16), once per count, each time the
#             checkpoint's first N layers (bench_e2e --layers): what the layer count does
#   deepseek  DeepSeek-V3 shapes, 1 dense + 2 MoE layers (FP8 experts): batch 1 and 4
# Needs the wheels in .whl/ (posix_ipc, grpcio, ...: the host has no network) and, for llama16,
# the llama.cpp tarball and run_peer.sh/convert_wrapper.py in .peer/ (carry .whl and .peer).
#   usage: bash tools/gpu_host_e2e.sh llama16|q16|qwen48|deepseek   (MODES, SPIN_US in the
#          environment)
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
part="${1:?usage: gpu_host_e2e.sh llama16|q16|qwen48|deepseek}"
# stream-off@2: the first mode again, last: drift, or what a mode leaves behind, shows
MODES="${MODES:-stream-off,stream-auto,stream-off@2}"
SPIN="${SPIN_US:+--spin-us $SPIN_US}"
work=/tmp/ktserve-e2e
mkdir -p "$work"
say() { echo "[$(date +%H:%M:%S)] $*"; }
build() { build_in_place "$work/build.log"; }
e2e() { local limit=$1; shift  # seconds, then bench_e2e's arguments
  timeout "$limit" python3 bench/bench_e2e.py "$@" 2>&1 | grep -v -E "INFO|^\s*$"; }

case "$part" in
llama16)
  build & b=$!
  (bash .peer/run_peer.sh build .peer/llama-src.tar.gz "$work/llama/build" cuda \
    > "$work/llama-build.log" 2>&1; echo "llama.cpp build rc=$?") & l=$!
  timeout 200 python3 bench/real_checkpoint.py "$work/q16" --shape qwen3 --layers 16 | tail -1
  wait $b || exit 1; wait $l; say built
  timeout 240 python3 bench/bench_e2e.py "$work/q16" --format int4 --threads 15 $SPIN \
    --batch 1,4,16,64 --prefill 512,2048,8192 --prefill-reps 1 --tokens 64 --modes "$MODES" \
    --max-num-batched-tokens 8192 --json "$out/q16.json" 2>&1 | grep -v -E "INFO|^\s*$" | tail -12
  timeout 150 bash .peer/run_peer.sh convert .peer/llama-src.tar.gz "$work/q16" \
    "$work/q16-bf16.gguf" | tail -1
  QUANTS=Q4_0 timeout 60 bash .peer/run_peer.sh quantize "$work/llama/build" \
    "$work/q16-bf16.gguf" "$work" | tail -1
  rm -f "$work/q16-bf16.gguf"
  e2e 150 "$work/q16" --format int4 --threads 15 --batch 1,4,16,64 --prefill 512,2048,8192 \
    --tokens 64 --resume "$out/q16.json" --llama-build "$work/llama/build" \
    --gguf "$work/q16-Q4_0.gguf" --peer-script .peer/run_peer.sh --llama-reps 1 ;;
q16)
  build & b=$!
  timeout 200 python3 bench/real_checkpoint.py "$work/q16" --shape qwen3 --layers 16 | tail -1
  wait $b || exit 1; say built
  cuda_tests "$out/tests-chained-cuda.log" 240 tests/gpu_service/engine/test_chained_steps.py
  e2e 400 "$work/q16" --format int4 --threads 15 $SPIN --batch "${BATCH:-1,4,16}" \
    --prefill "${PREFILL:-}" --prefill-reps 1 --tokens 64 --modes "$MODES" \
    --json "$out/q16.json" ;;
qwen48)
  build & b=$!
  timeout 150 python3 bench/real_checkpoint.py "$work/q48" --shape qwen3 --layers 48 \
    --experts fp8 | tail -1
  wait $b || exit 1; say built
  if [ -n "${LAYERS:-}" ]; then  # the first N layers of the same checkpoint, for each N
    counts=(${LAYERS//,/ })
    for n in "${counts[@]}"; do
      e2e $((420 / ${#counts[@]})) "$work/q48" --layers "$n" \
        --format int4 --threads 15 $SPIN --batch "${BATCH:-1,16}" --prefill "" --tokens 64 \
        --modes "$MODES" --json "$out/q48-$n.json"
    done
  else
    e2e 430 "$work/q48" --format int4 --threads 15 $SPIN --batch 1,4,16 \
      --prefill 512,2048,8192 --prefill-reps 1 --tokens 64 --modes "$MODES" \
      --max-num-batched-tokens 8192 --json "$out/q48.json"
  fi ;;
deepseek)
  build & b=$!
  timeout 100 python3 bench/real_checkpoint.py "$work/ds" --shape deepseek --layers 3 \
    --dense-layers 1 --experts fp8 | tail -1
  wait $b || exit 1; say built
  e2e 200 "$work/ds" --format int4 --threads 15 $SPIN --batch 1,4 --prefill "" \
    --tokens 32 --modes "$MODES" --json "$out/ds.json" ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
say done
