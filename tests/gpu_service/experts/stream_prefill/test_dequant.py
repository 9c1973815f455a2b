"""The GPU side's dequantization of the worker's packed formats against a numpy dequantization
written here from the layout ktk.h documents (element by element index arithmetic), and against
the original weights within each format's quantization bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expert_service.kernels import pack_experts
from gpu_service.experts.stream_prefill.dequant import dequantize
from tests.support.expert_stores import numpy_dequant

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# int4: |w - q*s| <= s/2 with s = amax/7 per group of 32, s rounded up to bf16; int8 per row.
BOUND = {"bf16": 2**-8, "int8": 0.5 / 127 * 1.01, "int4": 0.5 / 7 * 1.01}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("hidden, inter", [(72, 40), (128, 64), (56, 28)])
def test_dequantize_matches_the_documented_layout(fmt, hidden, inter, device, seed):
    g = torch.Generator().manual_seed(seed)
    e = 3
    gate = torch.randn(e, inter, hidden, generator=g)
    up = torch.randn(e, inter, hidden, generator=g)
    down = torch.randn(e, hidden, inter, generator=g)
    packed = pack_experts(gate, up, down, fmt, num_threads=1)
    want_gate, want_up, want_down = numpy_dequant(packed, hidden, inter)
    tensors = {n: torch.from_numpy(np.array(a)).to(device) for n, a in packed.tensors.items()}
    w13, w2 = dequantize(fmt, tensors, hidden, inter, torch.float32)
    w13, w2 = w13.cpu().numpy(), w2.cpu().numpy()
    # exact: the same products in float32
    np.testing.assert_array_equal(w13[:, :inter], want_gate)
    np.testing.assert_array_equal(w13[:, inter:], want_up)
    np.testing.assert_array_equal(w2, want_down)
    # and the original weights within the format's rounding
    for got, orig in ((w13[:, :inter], gate), (w13[:, inter:], up), (w2, down)):
        orig = orig.numpy()
        if fmt == "int4":
            groups = np.abs(np.pad(orig, ((0, 0), (0, 0), (0, -orig.shape[2] % 32))))
            amax = groups.reshape(*orig.shape[:2], -1, 32).max(-1)
            limit = np.repeat(amax, 32, axis=-1)[..., : orig.shape[2]]
        elif fmt == "int8":
            limit = np.abs(orig).max(-1, keepdims=True)
        else:
            limit = np.abs(orig)
        assert np.all(np.abs(got - orig) <= BOUND[fmt] * limit + 1e-30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_rounds_to_the_compute_dtype(fmt, dtype, device, seed):
    """bf16 / fp16 compute gets the float32 dequantization rounded once."""
    g = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(2, 40, 72, generator=g), torch.randn(2, 40, 72, generator=g),
                      torch.randn(2, 72, 40, generator=g))  # fmt: skip
    packed = pack_experts(gate, up, down, fmt, num_threads=1)
    tensors = {n: torch.from_numpy(np.array(a)).to(device) for n, a in packed.tensors.items()}
    exact = dequantize(fmt, tensors, 72, 40, torch.float32)
    rounded = dequantize(fmt, tensors, 72, 40, dtype)
    for a, b in zip(exact, rounded):
        assert b.dtype == dtype
        assert torch.equal(a.to(dtype), b)
