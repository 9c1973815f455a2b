"""One CUDA kernel each for RMSNorm and the rotary embedding (Triton), where torch runs 6-8.

At decode batch 1 a layer's GPU part is launch-bound: its ~90 kernels, most of them tiny
elementwise steps of RMSNorm's float32 math and of RoPE, cost more in their gaps than in their
work. These kernels compute what the torch code in layers.py / rope.py computes (the oracle; it
stays the CPU path), in the same float32 steps and with the same roundings:
    rms_norm: y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)        over the last dim
    rotary:   [x1 c - x2 s | x2 c + x1 s].to(x.dtype), (x1, x2) = halves or even/odd elements
`supports(...)` says when a tensor can take them (CUDA, Triton importable, unit last stride);
otherwise callers keep the torch code.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the torch code runs everywhere
    triton = None


ENABLED = [True]  # NOTE: process-wide; build_gpu_service sets it from --no-fused-kernels


def supports(*tensors: torch.Tensor) -> bool:
    return (
        triton is not None and ENABLED[0] and all(t.is_cuda and t.stride(-1) == 1 for t in tensors)
    )


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, dim, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride, x_head_stride, heads,
                       half, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        t, h = pid // heads, pid % heads
        i = tl.arange(0, BLOCK)
        mask = i < half
        src = x_ptr + t * x_token_stride + h * x_head_stride
        if INTERLEAVED:
            x1 = tl.load(src + 2 * i, mask=mask).to(tl.float32)
            x2 = tl.load(src + 2 * i + 1, mask=mask).to(tl.float32)
        else:
            x1 = tl.load(src + i, mask=mask).to(tl.float32)
            x2 = tl.load(src + half + i, mask=mask).to(tl.float32)
        c = tl.load(cos_ptr + t * half + i, mask=mask)
        s = tl.load(sin_ptr + t * half + i, mask=mask)
        dst = out_ptr + (t * heads + h) * 2 * half
        kind = out_ptr.dtype.element_ty
        tl.store(dst + i, (x1 * c - x2 * s).to(kind), mask=mask)
        tl.store(dst + half + i, (x2 * c + x1 * s).to(kind), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (rows of unit stride, evenly spaced), weight [D] of x's dtype -> [..., D]."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim) if not x.is_contiguous() else x.view(-1, dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), dim, eps,
                                           BLOCK=triton.next_power_of_2(dim))  # fmt: skip
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """x [T, heads, dim] (any token/head strides), cos/sin [T, dim/2] float32 -> [T, heads, dim]."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if x.numel():
        _rotary_kernel[(tokens * heads,)](
            x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), heads, dim // 2,
            INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(dim // 2),
        )  # fmt: skip
    return out
