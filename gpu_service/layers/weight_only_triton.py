"""Weight-only int8 and fp8 matmuls on CUDA, one small Triton kernel:
    y [M, N] = (x [M, K] @ q^T [K, N]) * scale [N],
q int8 or float8_e4m3fn [N, K], read once and converted to x's dtype in registers, float32
accumulation, output in x's dtype. torch has no CUDA kernel for int8 weights; for fp8 weights,
`torch._scaled_mm` quantizes the activations first (five kernels before the GEMM), which at a
decode step's few rows costs more than the GEMM. Few rows read weights and nothing else, so the
tiles are narrow (BLOCK_N 16 or 32) to spread them over every SM; up to GEMV_MAX_ROWS rows skip
the tensor cores (a 16-row tile of which one row is used) for a GEMV kernel of a few outputs a
program, many programs' loads in flight per SM.
linear.py's `weight_only_supported` runs it once per device and weight dtype on a small case
against dequantization before a layer uses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)

if triton is not None:

    @triton.jit(do_not_specialize=("M",))  # NOTE: the step's tokens: see attention_triton
    def _weight_only_mm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
                               stride_xm, stride_wn, stride_ym,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
        # NOTE: N tiles vary fastest: the programs of one row block share its x (L2)
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
            w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None],
                        mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)  # fmt: skip
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE))  # [BLOCK_M, BLOCK_N]
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)  # fmt: skip

    @triton.jit(do_not_specialize=("M",))  # NOTE: the step's tokens: see attention_triton
    def _weight_only_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
                                 stride_xm, stride_wn, stride_ym,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        # NOTE: a few rows: no tensor-core tile (16 rows of which one is used), a program per
        # BLOCK_N outputs, so that every SM has many programs' weight loads in flight; a row
        # after the first reads the program's weights again from its cache
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        for m in range(M):
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
                # exact products (int8 and e4m3 values are float32's), float32 sums: the tile
                # kernel's arithmetic in another order
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            tl.store(y_ptr + m * stride_ym + rn, (acc * scale).to(y_ptr.dtype.element_ty),
                     mask=n_ok)  # fmt: skip


@dataclass(frozen=True)
class MMTiles:
    """Launch shape of the weight-only kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


GEMV_MAX_ROWS = 1  # rows up to this take the GEMV kernel (GemvTiles) by default: at 4 rows
# it took about twice the tile kernel's time on the H200 (bench_weight_only_mm --gemv-sweep)


@dataclass(frozen=True)
class GemvTiles:
    """Launch shape of the few-rows kernel: outputs and K elements a program's step."""

    block_n: int
    block_k: int
    num_warps: int = 4


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (TRITON_INTERPRET=1) on CPU tensors
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1024)  # NOTE: per linear and step outside a graph: one lookup
def default_tiles(m: int, n: int, k: int, num_sms: int) -> MMTiles:
    """Decode rows (<= 16): 32 outputs a program where that still gives three quarters of the SMs
    one, else 16, and long K steps, deep pipelines (the weights' stream is all the work): the
    best of bench_weight_only_mm's sweep at DeepSeek-V3's shapes on the H200, one row, within 2%
    at each shape. More rows: 16-64 of them a program, the widest of 64 / 32 / 16 outputs that
    gives every SM two programs, K steps of 128."""
    if m <= 16:
        block_n = 32 if -(-n // 32) * 4 >= num_sms * 3 else 16
        long_k = k >= 4096
        block_k = 512 if long_k and block_n == 32 else 256
        return MMTiles(16, block_n, min(block_k, max(16, triton.next_power_of_2(k))),
                       num_stages=4 if long_k else 3)  # fmt: skip
    block_m = 32 if m <= 32 else 64
    row_blocks = -(-m // block_m)
    block_n = next((b for b in (64, 32) if row_blocks * -(-n // b) >= 2 * num_sms), 16)
    block_k = 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    return MMTiles(block_m, block_n, block_k)


@functools.lru_cache(maxsize=1024)  # NOTE: per linear and step outside a graph, as default_tiles
def default_gemv_tiles(n: int, k: int) -> GemvTiles:
    """4 outputs a program and K steps of up to 2048: for Qwen3-30B-A3B's o_proj (2048 x 4096)
    512 programs, 32 KB of weights in flight per SM."""
    return GemvTiles(4, min(2048, max(16, triton.next_power_of_2(k))))


def _dot_dtype(x: torch.Tensor):
    """x's dtype on CUDA; float32 under the interpreter (CPU tensors), whose numpy dot cannot
    take bf16 (the products are exact there: x's values, the weights' upcast)."""
    if x.device.type == "cuda":
        return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32)
    return tl.float32


def weight_only_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   tiles: MMTiles | GemvTiles | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] (contiguous, float16/bfloat16/float32), q int8 or float8_e4m3fn [N, K]
    contiguous, scale [N] (any float dtype) -> [M, N] in x's dtype. Up to GEMV_MAX_ROWS rows
    take the GEMV kernel unless `tiles` names the tile kernel's shape."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if tiles is None and m <= GEMV_MAX_ROWS:
        tiles = default_gemv_tiles(n, k)
    if isinstance(tiles, GemvTiles):
        _weight_only_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
            x, q, scale, y, m, n, k, x.stride(0), q.stride(0), y.stride(0),
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        )  # fmt: skip
        return y
    t = tiles or default_tiles(m, n, k, _num_sms(x.device))
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    _weight_only_mm_kernel[grid](x, q, scale, y, m, n, k, x.stride(0), q.stride(0), y.stride(0),
                                 BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                 DOT_DTYPE=_dot_dtype(x), num_warps=t.num_warps,
                                 num_stages=t.num_stages)  # fmt: skip
    return y
