"""Weight-only int8 matmul on CUDA, a small Triton kernel (torch has none there):
    y [M, N] = (x [M, K] @ q^T [K, N]) * scale [N], q int8 [N, K] read once per N tile and
converted in registers, float32 accumulation, output in x's dtype.
`int8_mm_available(device)` runs it once on a small case against torch and answers False (the
caller then dequantizes per call) where Triton is missing or the kernel fails or disagrees.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("ktserve.gpu")

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

if triton is not None:

    @triton.jit(do_not_specialize=("M",))  # NOTE: the step's tokens: see attention_triton
    def _int8_mm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
                        stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
            w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None],
                        mask=(rn[None, :] < N) & (k[:, None] < K), other=0)  # fmt: skip
            acc += tl.dot(x, w.to(x.dtype))  # [BLOCK_M, BLOCK_N]
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)  # fmt: skip


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous, float16/bfloat16/float32), q int8 [N, K] contiguous, scale [N]."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_mm_kernel[grid](x, q, scale, y, m, n, k, x.stride(0), q.stride(0), y.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)  # fmt: skip
    return y


@functools.cache
def int8_mm_available(device: torch.device) -> bool:
    if triton is None or device.type != "cuda":
        return False
    try:
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(5, 200, generator=gen, device=device, dtype=torch.bfloat16)
        q = torch.randint(-127, 128, (72, 200), generator=gen, device=device, dtype=torch.int8)
        scale = torch.rand(72, generator=gen, device=device) / 100
        want = (x.float() @ q.float().T) * scale
        got = int8_mm(x, q, scale.to(x.dtype)).float()
        err = float((got - want).norm() / want.norm())
        if err > 1e-2:
            log.warning(
                "int8 Triton kernel disagrees with torch (%.2e): dequantizing per call", err
            )
            return False
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means the per-call fallback
        log.warning("int8 Triton kernel unavailable (%s): dequantizing per call", exc)
        return False
