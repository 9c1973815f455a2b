#!/usr/bin/env bash
# A change's end-to-end effect on the GPU host, in one self-contained call: bench_e2e's decode on
# 16 Qwen3-30B-A3B layers (bf16 experts served as int4, one worker of 15 threads) from this tree
# and from a baseline tree (BASE: a tar of another commit's sources, e.g. `git archive REV -o
# .device/base.tar -- setup.py pyproject.toml expert_service bench tests ktshm ktserve proto
# gpu_service`), both built, then run in turn ROUNDS times, so the host's drift hits both alike.
# Carry .whl (gpu_host_env.sh) and the tar's folder. Logs and each run's JSON go to $OUT.
#   usage: BASE=.device/base.tar MODES=graph,graph-d1 BATCH=1,4,16 ROUNDS=2 bash tools/gpu_host_ab.sh
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
base="${BASE:?BASE: a tar of the baseline sources}"
modes="${MODES:-graph,graph-d1}"
batch="${BATCH:-1,4,16}"
rounds="${ROUNDS:-2}"
work=/tmp/ktserve-e2e
base_tree=/tmp/ab-base
mkdir -p "$work"
say() { echo "[$(date +%H:%M:%S)] $*"; }
build_in_place & this_build=$!
build_tree "$base" "$base_tree" "$out/base-build.log" & base_build=$!
# a checkpoint an earlier call left on this (warm) machine is the same seeded one
[ -f "$work/q16/config.json" ] ||
  timeout 200 python3 bench/real_checkpoint.py "$work/q16" --shape qwen3 --layers 16 | tail -1
wait "$base_build" || exit 1
wait "$this_build" || exit 1
say built
rc=0
for r in $(seq "$rounds"); do
  for tree in "$base_tree" "$PWD"; do
    name=$([ "$tree" = "$PWD" ] && echo this || echo base)
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout 240 python3 bench/bench_e2e.py \
       "$work/q16" --format int4 --threads 15 --batch "$batch" --prefill "" --tokens 64 \
       --modes "$modes" --json "$out/ab-$r-$name.json") > "$out/ab-$r-$name.log" 2>&1 || rc=1
    say "$name, round $r"
    grep -v -E "INFO|^\s*$" "$out/ab-$r-$name.log" | grep -E "^(mode|graph|segments|stream|eager)"
  done
done
exit $rc
