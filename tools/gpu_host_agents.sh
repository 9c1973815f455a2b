#!/usr/bin/env bash
# Issue 16 on the GPU host, in one self-contained call (the host starts bare every call): the
# sampler, the grammar masks and the prefix cache on CUDA, then the agent-conversation replay
# with the GPU part on CUDA.
#   1. the wheels in .whl/ (the host has no network): posix_ipc, grpcio-health-checking,
#      grpcio-tools, grpcio, protobuf as for gpu_host_check.sh, and for these tests llguidance,
#      fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection,
#      annotated-doc, opentelemetry-api, jsonschema, jsonschema-specifications, referencing,
#      rpds-py, typing-extensions, anyio; then the extensions built in place
#   2. KTSERVE_TEST_DEVICE=cuda: tests/gpu_service/engine/test_{sampling,grammar,prefix_cache}.py
#      on the GPU (the sampler and masks against CPU references; caches, host-tier copies, engines
#      and captured decode graphs on CUDA); a test skipped for want of CUDA fails this script
#   3. bench/bench_prefix_cache.py --device cuda on the demo model: its table
# Logs go to $OUT (or ./gpu-host-out).
#   usage: bash tools/gpu_host_agents.sh [tests|bench|all]   (REPEATS, THREADS in the environment)
set -uo pipefail
source "$(dirname "$0")/gpu_host_env.sh" || exit 1
what="${1:-all}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - <<'EOF' || exit 1
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
missing = []
for name in ("llguidance", "fastapi", "pydantic", "jsonschema", "posix_ipc", "grpc_health",
             "grpc_tools", "transformers"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')}")
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
if missing or not torch.cuda.is_available():
    sys.exit(f"cannot run: missing {missing}, CUDA available: {torch.cuda.is_available()}")
EOF
build_in_place || exit 1
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  cuda_tests "$out/tests-cuda.log" 420 tests/gpu_service/engine/test_sampling.py \
    tests/gpu_service/engine/test_grammar.py tests/gpu_service/engine/test_prefix_cache.py || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 300 python3 bench/bench_prefix_cache.py --device cuda --threads "${THREADS:-8}" \
    --repeats "${REPEATS:-3}" > "$out/bench-prefix-cache.log" 2>&1 || rc=1
  grep -v -E "INFO|Token indices|^\s*$" "$out/bench-prefix-cache.log" | tail -16
fi
exit $rc
