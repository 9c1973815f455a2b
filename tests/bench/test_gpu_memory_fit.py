"""bench/gpu_memory_fit.py on the GPU host: DeepSeek-V3's GPU part in fp8 or int4 (random weights,
real shapes, every layer) with a 32k-token KV cache, one prefill chunk and one decode step, in a
process capped at 24 GiB. A subprocess, so the cap binds no other test."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.common import REPO

CAP_GIB = 24


def _big_enough() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_properties(0).total_memory > (CAP_GIB + 2) * 2**30
    )


@pytest.mark.skipif(not _big_enough(), reason=f"needs a CUDA GPU of more than {CAP_GIB + 2} GiB")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_deepseek_v3_gpu_part_fits_24_gib(fmt: str) -> None:
    seed = 0
    cmd = [sys.executable, str(REPO / "bench" / "gpu_memory_fit.py"), "--format", fmt,
           "--cap-gib", str(CAP_GIB), "--context", "32768", "--seed", str(seed)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(f"seed={seed}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0
    assert proc.stdout.rstrip().endswith("fits")
