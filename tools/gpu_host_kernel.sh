#!/usr/bin/env bash
# The CPU MoE kernel on the GPU host's AMX Xeon, in one self-contained call (the host starts bare
# every call; carry .whl, see gpu_host_env.sh): kernel tests on the real tiles and on emulated
# ones, then bench_moe_kernel.py at Qwen3-30B-A3B and DeepSeek-V3 shapes; with a baseline tree
# (BASE: a tar of another commit's sources, e.g. `git archive REV -o .device/base.tar -- setup.py
# pyproject.toml expert_service bench tests ktshm ktserve proto gpu_service`), that tree is built
# beside this one and the two benches alternate, ROUNDS times each, so drift hits both alike;
# with IN_PROCESS=1 instead, each round is one bench process that loads both kernels and times
# them in turn on the same weights (bench_moe_kernel.py --baseline-tree: less noise). BASE may name
# several tars, comma-separated (variants of one change: each is built in /tmp/kernel-<its stem>,
# and its rows are "baseline:kernel-<stem>").
# KT_KERNEL: a tar of kt-kernel's AMX extension and the libraries it links (kt_kernel/ and
# kt_kernel.libs/ from its wheel, whose whole 101 MB is over a call's carry), unpacked onto the
# path, and the benches time it beside ours (bench_moe_kernel.py --peer kt-kernel, PEER_FORMATS).
# SHAPES and TOKENS narrow the bench, REPEATS sets its --repeats (3); TESTS=0 skips the tests;
# BENCH_TIMEOUT (s, 150) bounds each bench process (a peer or a baseline tree adds to its time);
# BENCH_ARGS: more bench_moe_kernel.py flags (e.g. --huge-pages).
# Logs go to $OUT (or ./gpu-host-out).
#   usage: BASE=.device/base.tar FORMATS=int4 ROUNDS=2 bash tools/gpu_host_kernel.sh
#          BASE=.device/base.tar IN_PROCESS=1 REPEATS=7 ROUNDS=1 FORMATS=int4 bash tools/gpu_host_kernel.sh
#          KT_KERNEL=.peer/kt_kernel_amx.tar.gz SHAPES=dsv3 TOKENS=1 bash tools/gpu_host_kernel.sh
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
base="${BASE:-}"
formats="${FORMATS:-int8,int4}"
rounds="${ROUNDS:-2}"
shapes="${SHAPES:-dsv3,qwen3}"
tokens="${TOKENS:-1,16}"
peer=()
if [ -n "${KT_KERNEL:-}" ]; then
  tar -xzf "$KT_KERNEL" -C /tmp/site || exit 1
  peer=(--peer kt-kernel --peer-formats "${PEER_FORMATS:-int4}")
fi
say() { echo "[$(date +%H:%M:%S)] $*"; }
build_in_place & this_build=$!
base_dirs=()
base_builds=()
if [ -n "$base" ]; then
  IFS=, read -ra base_tars <<< "$base"
  for tar in "${base_tars[@]}"; do
    if [ ${#base_tars[@]} = 1 ]; then dir=/tmp/kernel-base; else
      stem=$(basename "$tar"); dir=/tmp/kernel-${stem%%.*}; fi
    base_dirs+=("$dir")
    build_tree "$tar" "$dir" "$out/$(basename "$dir")-build.log" & base_builds+=($!)
  done
fi
for pid in "${base_builds[@]}"; do wait "$pid" || exit 1; done
wait "$this_build" || exit 1
say built
rc=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/expert_service/test_kernels.py \
    tests/expert_service/test_kernel_marks.py \
    tests/expert_service/test_amx_emulated.py > "$out/kernel-tests.log" 2>&1 || rc=1
  tail -2 "$out/kernel-tests.log"
fi
trees=("$PWD")
baseline=()
if [ -n "$base" ] && [ "${IN_PROCESS:-0}" != 0 ]; then
  baseline=(--baseline-tree "$(IFS=,; echo "${base_dirs[*]}")")
elif [ -n "$base" ]; then
  trees=("${base_dirs[@]}" "$PWD")
fi
for r in $(seq "$rounds"); do
  for tree in "${trees[@]}"; do
    name=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout "${BENCH_TIMEOUT:-150}" python3 bench/bench_moe_kernel.py \
       --threads 15 --shapes "$shapes" --formats "$formats" --tokens "$tokens" --prefill-tokens 512 \
       --no-torch --repeats "${REPEATS:-3}" --min-seconds 0.3 "${peer[@]}" "${baseline[@]}" ${BENCH_ARGS:-}) > "$out/kernel-$r-$name.log" 2>&1 || rc=1
    say "$name, round $r"
    grep -E "^(DeepSeek|Qwen3)|kt-kernel|^baseline|huge pages" "$out/kernel-$r-$name.log"
    grep -E "^DRAM read samples" "$out/kernel-$r-$name.log"
  done
done
exit $rc
