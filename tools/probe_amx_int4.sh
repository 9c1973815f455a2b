#!/usr/bin/env bash
# Builds tools/probe_amx_int4.cpp against this tree's ktk_amx.cpp (setup.py's flags for it) and
# runs it at DeepSeek-V3's gate/up and down K (7168, 2048) and Qwen3-30B-A3B's (2048, 768): where
# an int4 AMX pass's time goes, part by part. Needs AMX (the GPU host).
#   usage: [ROUNDS=3] bash tools/probe_amx_int4.sh [THREADS (15)] [K ...]
set -euo pipefail
cd "$(dirname "$0")/.."
flags=$(python3 -c 'import ast, re, sys
src = open("setup.py").read()
table = ast.literal_eval(re.search(r"KERNEL_ISA_FLAGS = (\{.*?\})", src, re.S).group(1))
print(" ".join(table["ktk_amx.cpp"]))')
bin="${TMPDIR:-/tmp}/probe_amx_int4"
g++ -O3 -std=c++17 $flags -o "$bin" tools/probe_amx_int4.cpp -lpthread
threads="${1:-15}"
shift || true
ks=("$@")
[ ${#ks[@]} -gt 0 ] || ks=(7168 2048 768)
for k in "${ks[@]}"; do
  "$bin" "$k" "$threads" "${ROUNDS:-3}"
done
