#!/usr/bin/env bash
# The GPU host's checks, in one go: build in place, the CPU-side tests on every instruction set
# the host has (AVX-512, AMX), the two-process parity on the CUDA path (against references made
# here by `python tools/parity_on_gpu_host.py make .device/parity`: the host's transformers is
# not the pinned one), and the benchmarks. Logs go to $OUT (or ./gpu-host-out). Wheels in .whl/
# (posix_ipc, ...) are installed first: the GPU host has no network.
#   usage: bash tools/gpu_host_check.sh [tests|bench|all] [PARITY_REFERENCE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
what="${1:-all}"
refs="${2:-.device/parity}"
nproc; lscpu | grep -E 'Model name|Flags' | sed 's/Flags:.*\(amx[a-z_0-9 ]*\).*/AMX flags: \1/'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
build_in_place || exit 1
python3 -c "from expert_service.kernels import available_isas; print('kernel ISAs:', available_isas())"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider tests/expert_service/test_kernels.py tests/ktshm \
    2>&1 | tee "$out/tests-cpu.log" | tail -5
  python3 -m pytest -q -p no:cacheprovider -rs tests/gpu_service/attention/test_paged_attention.py \
    tests/gpu_service/engine/test_decode_graphs.py 2>&1 | tee "$out/tests-attention-cuda.log" | tail -8
  python3 tools/parity_on_gpu_host.py check "$refs" --device cuda 2>&1 | tee "$out/parity-cuda.log" \
    | grep -v -E "Loading|Writing"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/bench_moe_kernel.py --threads 15 2>&1 | tee "$out/bench-kernel.log"
  python3 bench/bench_quality.py --device cuda --threads 8 2>&1 | tee "$out/bench-quality.log"
  python3 bench/bench_ktshm.py --iters 5000 2>&1 | tee "$out/bench-ktshm.log"
  # the worker side of a call: its parts back to back, then with the GPU's time between layers
  python3 bench/bench_worker_call.py --threads 15 --layers 48 --format int4 --tokens 1,4,16 \
    2>&1 | tee "$out/bench-worker-call.log"
  python3 bench/bench_worker_call.py --threads 15 --layers 48 --format int4 --tokens 1 \
    --gap-us 300 2>&1 | tee "$out/bench-worker-call-gap.log"
  python3 tools/bench_worker_dispatch.py --rounds 5 2>&1 | tee "$out/bench-worker-dispatch.log"
fi
