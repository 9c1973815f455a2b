#!/usr/bin/env bash
# Issue 45 on the GPU host: N concurrent agent sessions (bench/agent_replay.py) against ktserve
# and llama-server on the same checkpoint (16 Qwen3-30B-A3B layers of random weights; llama.cpp
# on its Q4_0, the bytes per expert of ktserve's int4), both driven over HTTP by one client.
#   prepare  llama.cpp built from .device/llamacpp/llama-src.tar.gz (prune_src.sh's output, with
#            run_peer.sh and convert_wrapper.py beside it), the checkpoint written, converted to
#            GGUF and quantized to Q4_0, all under /tmp/ktserve-replay (kept while the machine
#            stays warm: run `replay` in the next call within its idle time)
#   replay   `ktserve serve` with its defaults (--format int4) and llama-server as users run a
#            MoE (-ngl 99 -ot exps=CPU, 16 slots, one KV cache of CTX tokens, --jinja for the
#            sessions' tools), SESSIONS sessions of TURNS turns replayed against each, both
#            stopped; the table to $OUT/replay.log
#   all      both, in one call (about 10 minutes: split it where a call has less)
# Carry .whl and .device.
#   usage: SESSIONS=1,4,16 TURNS=3 bash tools/gpu_host_replay.sh [prepare|replay|all]
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
part="${1:-all}"
peer=.device/llamacpp
work=/tmp/ktserve-replay
ckpt="$work/q16"
gguf="$work/model-Q4_0.gguf"
mkdir -p "$work"
say() { echo "[$(date +%H:%M:%S)] $*"; }

prepare() {
  build_in_place || return 1
  if [ ! -x "$work/build/bin/llama-server" ]; then
    bash "$peer/run_peer.sh" build "$peer/llama-src.tar.gz" "$work/build" cuda \
      > "$out/llama-build.log" 2>&1 || { tail -20 "$out/llama-build.log"; return 1; }
  fi
  say "llama.cpp built"
  [ -f "$ckpt/config.json" ] ||
    python3 bench/real_checkpoint.py "$ckpt" --shape qwen3 --layers 16 | tail -1
  if [ ! -f "$gguf" ]; then
    # NOTE: the bf16 GGUF goes once quantized: the disk holds the checkpoint and Q4_0 besides
    bash "$peer/run_peer.sh" convert "$peer/llama-src.tar.gz" "$ckpt" "$work/model-bf16.gguf" \
      > "$out/convert.log" 2>&1 || { tail -20 "$out/convert.log"; return 1; }
    QUANTS=Q4_0 bash "$peer/run_peer.sh" quantize "$work/build" "$work/model-bf16.gguf" "$work" \
      > "$out/quantize.log" 2>&1 || { tail -20 "$out/quantize.log"; return 1; }
    rm -f "$work/model-bf16.gguf"
  fi
  say "checkpoint and its Q4_0 GGUF ready"
}

wait_healthy() {  # URL PID NAME: polls until the server answers, fails if it exits or takes 300 s
  local url="$1" pid="$2" name="$3" deadline=$((SECONDS + 300))
  until curl -sf "$url" > /dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$name exited before it answered"; return 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "$name did not answer in 300 s"; return 1; }
    sleep 1
  done
  say "$name answers"
}

replay() {
  [ -f "$gguf" ] || { echo "no $gguf: run the prepare part first (on this warm machine)"; return 1; }
  build_in_place || return 1
  python3 -m ktserve serve "$ckpt" --format int4 --port 8000 > "$out/ktserve.log" 2>&1 &
  local kt=$! ll="" rc=0
  # NOTE: llama-server starts once ktserve answers: their start-ups do not share the CPU
  if wait_healthy http://127.0.0.1:8000/health "$kt" ktserve; then
    "$work/build/bin/llama-server" -m "$gguf" -ngl 99 -ot exps=CPU -t 15 -c "${CTX:-262144}" \
      -np 16 --kv-unified -fa on --jinja --port 8002 --alias model \
      > "$out/llama-server.log" 2>&1 &
    ll=$!
  fi
  if [ -n "$ll" ] && wait_healthy http://127.0.0.1:8002/health "$ll" llama-server; then
    python3 bench/agent_replay.py --target ktserve=http://127.0.0.1:8000 \
      --target llama=http://127.0.0.1:8002 --sessions "${SESSIONS:-1,4,16}" \
      --turns "${TURNS:-3}" --json "$out/replay.json" 2>&1 | tee "$out/replay.log" || rc=1
  else
    rc=1
    tail -20 "$out/ktserve.log" "$out/llama-server.log" 2>/dev/null
  fi
  kill $kt $ll 2>/dev/null
  wait $kt $ll 2>/dev/null
  return $rc
}

case "$part" in
  prepare) prepare ;;
  replay) replay ;;
  all) prepare && replay ;;
  *) echo "usage: gpu_host_replay.sh [prepare|replay|all]"; exit 2 ;;
esac
