"""tools/gpu_memory_fit.py on the GPU host: DeepSeek-V3's GPU part in fp8 or int4 (random weights,
real shapes, every layer) with a 32k-token KV cache, one prefill chunk and one decode step, in a
process capped at 24 GiB. A subprocess, so the cap binds no other test. Anywhere: its
--weights-only count on the meta device, against the formats' bytes per weight."""

from __future__ import annotations

import re
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
    cmd = [sys.executable, str(REPO / "tools" / "gpu_memory_fit.py"), "--format", fmt,
           "--cap-gib", str(CAP_GIB), "--context", "32768", "--seed", str(seed)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(f"seed={seed}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0
    assert proc.stdout.rstrip().endswith("fits")


def _weights_only(fmt: str) -> dict[str, float]:
    cmd = [sys.executable, str(REPO / "tools" / "gpu_memory_fit.py"), "--weights-only",
           "--format", fmt]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    rows = re.findall(r"^([^|\n-][^|\n]*?)\s*\|\s*([0-9.]+)\s*$", proc.stdout, re.M)
    return {name: float(gib) for name, gib in rows}


def test_weights_only_counts_the_gpu_part_by_format() -> None:
    """The meta-device build (every layer of DeepSeek-V3's GPU part, nothing allocated) runs
    anywhere; fp8 linears hold one byte per weight where bf16 hold two (block scales: 4 bytes per
    128 x 128, ~0.02%), and the rest is the same in both."""
    bf16, fp8 = _weights_only("bf16"), _weights_only("fp8")
    assert fp8["linears (the format)"] == pytest.approx(bf16["linears (the format)"] / 2, rel=2e-3)
    for part in ("MLA kv_b (bf16)", "embedding (bf16)", "norms, routers", "KV cache, 32768 tokens"):
        assert fp8[part] == bf16[part], part
    assert fp8["all weights"] < 0.6 * bf16["all weights"]
