"""The Triton int4 dequantization against the torch one (dequant.py, itself checked against the
documented layout): bit for bit, in float32 and bfloat16. On CUDA where there is one (the GPU
host), else in Triton's interpreter on the CPU."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from expert_service.kernels import pack_experts
from gpu_service.experts.stream_prefill import dequant

triton = pytest.importorskip("triton")


@pytest.fixture
def kernel(monkeypatch):
    """The module, compiled for CUDA or interpreted on the CPU (reloaded as it was after)."""
    from gpu_service.experts.stream_prefill import int4_triton

    cuda = torch.cuda.is_available()
    if not cuda:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(int4_triton)
    yield int4_triton, "cuda" if cuda else "cpu"
    if not cuda:
        monkeypatch.delenv("TRITON_INTERPRET")
        importlib.reload(int4_triton)


@pytest.mark.parametrize("work", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inter", [(72, 40), (128, 64)])
def test_triton_int4_equals_the_torch_dequantization(kernel, hidden, inter, work, seed):
    module, device = kernel
    g = torch.Generator().manual_seed(seed)
    e = 3
    gate = torch.randn(e, inter, hidden, generator=g)
    up = torch.randn(e, inter, hidden, generator=g)
    down = torch.randn(e, hidden, inter, generator=g)
    packed = pack_experts(gate, up, down, "int4", num_threads=1)
    t = {n: torch.from_numpy(np.array(a)).to(device) for n, a in packed.tensors.items()}
    hp, ip = dequant.padded(hidden), dequant.padded(inter)
    for which, blocks, k in (("13", 2 * ip // 16, hp), ("2", hp // 16, ip)):
        w, s = t[f"w{which}"], t[f"s{which}"].view(torch.int16)
        want = dequant._rows_int4(w.cpu(), s.cpu(), blocks, k, work)
        got = module.rows_int4(w, s, blocks, k, work).cpu()
        assert got.dtype == work
        assert torch.equal(got, want)
