"""MLA prefill over expanded keys: a prompt chunk attends to its visible latent rows decompressed
per head, as transformers computes MLA, instead of to the absorbed latent.

Per query-key pair the absorbed form (deepseek.py) multiplies over the latent twice, scores over
[c | k_rot] and values c: h * (2r + rope) multiply-adds; the expanded form over
[k_nope | k_rot] and v: h * (nope + rope + v), after decompressing each visible key once,
k_nope = W_uk c and v = W_uv c (r * h * (nope + v) per key). A chunk of n queries is cheaper
expanded when n * (2r - nope - v) > r * (nope + v): above 171 queries at DeepSeek-V3's shapes
(r 512, nope 128, v 128; 2.4x fewer FLOPs at 1,024), 64 at the demo model's. Decode rows stay
absorbed.

It runs where attention_triton's prefill kernel does (AttentionBackend.expanded_prefill_kernel:
CUDA), as multi-head attention with D = nope + rope and Dv = v (padded to the kernel's 16 where
smaller) over the expanded keys laid out as a one-block cache (slot = position). On the CPU the
absorbed form stays, faster there (bench/bench_mla_prefill.py): one kv head stacks all heads'
queries into one GEMM, while expanded each head is its own.

The keys are expanded a block at a time, EXPANDED_BLOCK_BYTES of keys and values per block, so
the transient memory is bounded at any context: blocks wholly before the chunk go through the
kernel unmasked (every query sees them), the last one, from the chunk's first position (or
earlier) to its end, causal; the blocks' outputs merge by their rows' log-sum-exps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu_service.kvcache.tensors import read_cache

if TYPE_CHECKING:
    from gpu_service.attention.batch import AttentionGroup

# NOTE: a block's keys and values are transient, within the memory plan's smallest headroom
# (MIN_HEADROOM); the chunk's own block may be larger, as the plan's profile prefill measured it
EXPANDED_BLOCK_BYTES = 256 << 20
MIN_DIM = 16  # the kernel's smallest head dims (tensor-core tiles)


def worth_expanding(num_queries: int, rank: int, nope: int, v_dim: int) -> bool:
    """Whether a chunk of num_queries queries costs fewer multiply-adds expanded than absorbed."""
    return num_queries * (2 * rank - nope - v_dim) > rank * (nope + v_dim)


def expanded_prefill(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    cache: torch.Tensor,
    group: AttentionGroup,
    block_size: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kernel: Callable,
    block_bytes: int = EXPANDED_BLOCK_BYTES,
) -> torch.Tensor:
    """q_nope [n, h, nope] and q_rot [n, h, rope] (the group's rows, roped), cache [S, r + rope]
    (latent c, then k_rot), w_uk [h, nope, r], w_uv [h, v, r] -> [n, h, v] in q's dtype.
    kernel: a paged_prefill taking causal= and lse= (attention_triton's)."""
    heads, nope, rank = w_uk.shape
    v_dim, rope = w_uv.shape[1], q_rot.shape[-1]
    out = q_nope.new_empty((q_nope.shape[0], heads, v_dim))
    pad_d, pad_v = max(0, MIN_DIM - nope - rope), max(0, MIN_DIM - v_dim)
    q = F.pad(torch.cat((q_nope, q_rot), dim=-1), (0, pad_d))  # [n, h, D]
    per_key = heads * (2 * nope + rope + pad_d + v_dim + pad_v) * q.element_size()
    key_block = max(block_size, block_bytes // per_key)
    starts, lengths = group.cu_seqlens_q.tolist(), group.kv_len.tolist()

    def attend(rows: slice, table: torch.Tensor, k0: int, k1: int, causal: bool, lse: bool):
        c, k_rot = _latent(cache, table, k0, k1, block_size, rank, q.dtype)
        k_nope = (c @ w_uk.reshape(heads * nope, -1).T).view(k1 - k0, heads, nope)
        keys = torch.cat((k_nope, k_rot[:, None, :].expand(-1, heads, -1)), dim=-1)
        values = (c @ w_uv.reshape(heads * v_dim, -1).T).view(k1 - k0, heads, v_dim)
        keys, values = F.pad(keys, (0, pad_d)), F.pad(values, (0, pad_v))
        return _one_block(kernel, q[rows], keys, values, scale, causal, lse)

    for i, length in enumerate(lengths):
        rows = slice(starts[i], starts[i + 1])
        first = length - (rows.stop - rows.start)  # the chunk's first position
        table = group.block_table[i]
        causal_from = min(first, max(0, length - key_block))  # the chunk's own block
        blocks = [(k0, min(causal_from, k0 + key_block)) for k0 in range(0, causal_from, key_block)]
        result, lse = attend(rows, table, causal_from, length, True, bool(blocks))
        for k0, k1 in blocks:  # NOTE: wholly before the chunk: every query sees all of them
            block_out, block_lse = attend(rows, table, k0, k1, False, True)
            result, lse = _merge(result, lse, block_out, block_lse)
        out[rows] = result[..., :v_dim]  # (cast back from float32 where blocks merged)
    return out


def _latent(cache: torch.Tensor, table: torch.Tensor, k0: int, k1: int, block_size: int,
            rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """c [K, r] and k_rot [K, rope] of positions k0 .. k1 - 1, as dtype."""
    pos = torch.arange(k0, k1, device=cache.device)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    latent = read_cache(cache, slots).to(dtype)
    return latent[:, :rank], latent[:, rank:]


def _one_block(
    kernel: Callable,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    causal: bool,
    lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernel over keys / values [K, h, *] as a one-block cache (slot = position), the queries
    at its last positions: ([n, h, Dv], the rows' base-2 log-sum-exps [n, h] float32 or None)."""
    n, length, device = q.shape[0], keys.shape[0], keys.device
    table = torch.zeros((1, 1), dtype=torch.int32, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    kv_len = torch.tensor([length], dtype=torch.int32, device=device)
    row_lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device) if lse else None
    out = kernel(q, keys, values, table, cu, kv_len, length, scale, causal=causal, lse=row_lse)
    return out, row_lse


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two normalized attentions [n, h, Dv] over disjoint key ranges with their base-2
    log-sum-exps [n, h] -> the attention over both (float32), and its log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp2(lse_a - top), torch.exp2(lse_b - top)
    total = weight_a + weight_b
    merged = out_a.float() * weight_a[..., None] + out_b.float() * weight_b[..., None]
    return merged / total[..., None], top + torch.log2(total)
