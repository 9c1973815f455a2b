"""The GPU side's dequantization of the worker's packed formats against a numpy dequantization
written here from the layout ktk.h documents (element by element index arithmetic), and against
the original weights within each format's quantization bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expert_service.kernels import pack_experts
from gpu_service.experts.stream_prefill.dequant import dequantize

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def roundup64(n: int) -> int:
    return -(-n // 64) * 64


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def numpy_matrix(fmt: str, w: np.ndarray, s: np.ndarray | None, rows: int, k: int) -> np.ndarray:
    """One expert's packed matrix of `rows` padded output rows over padded K -> float32 [rows, k],
    from ktk.h's formulas: element (k, r) of block j."""
    r = np.arange(rows)[:, None]  # [rows, 1]
    kk = np.arange(k)[None, :]  # [1, k]
    j, rb = r // 16, r % 16
    if fmt == "bf16":
        at = j * (16 * k) + (kk // 2) * 32 + rb * 2 + kk % 2
        return bf16_to_f32(w[at])
    if fmt == "int8":
        at = j * (16 * k) + (kk // 4) * 64 + rb * 4 + kk % 4
        return w.view(np.int8)[at].astype(np.float32) * s[j * 16 + rb]
    g, quad = kk // 32, (kk % 32) // 4
    at = j * (8 * k) + g * 256 + (quad % 4) * 64 + rb * 4 + kk % 4
    byte = w[at].astype(np.int32)
    nibble = np.where(quad < 4, byte & 0x0F, byte >> 4)
    scale = bf16_to_f32(s[(j * (k // 32) + g) * 16 + rb])
    return (nibble - 8).astype(np.float32) * scale


def numpy_dequant(packed, hidden: int, inter: int):
    """gate, up [E, I, H], down [E, H, I] float32 from the packed buffers."""
    hp, ip = roundup64(hidden), roundup64(inter)
    t = packed.tensors
    gates, ups, downs = [], [], []
    for e in range(packed.num_experts):
        s13 = t["s13"][e] if "s13" in t else None
        s2 = t["s2"][e] if "s2" in t else None
        m13 = numpy_matrix(packed.fmt, t["w13"][e], s13, 2 * ip, hp)  # blocks gate, up, ...
        blocks = m13.reshape(ip // 16, 2, 16, hp)
        gates.append(blocks[:, 0].reshape(ip, hp)[:inter, :hidden])
        ups.append(blocks[:, 1].reshape(ip, hp)[:inter, :hidden])
        downs.append(numpy_matrix(packed.fmt, t["w2"][e], s2, hp, ip)[:hidden, :inter])
    return np.stack(gates), np.stack(ups), np.stack(downs)


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
