"""Paged attention over the block table, without padding: batched decode and ragged prefill.

The cache (kvcache/tensors.py) is one tensor per component, [S, Hkv, D]; a sequence's position
p lives in slot block_table[p // block_size] * block_size + p % block_size. A step's sequences
split in groups (batch.py, AttentionMetadata): decodes (one query each, at position kv_len - 1;
on the CPU one group per width class) and prefills (n_i queries at positions
kv_len_i - n_i .. kv_len_i - 1, causal over their own keys).

The functions here are the plain-torch reference, the CPU path and the oracle of the GPU kernels
(`gpu_service.attention.attention_triton`); a model's AttentionBackend (backend.py) picks which
run. Their math is transformers' eager attention: (q k^T) * scale in q's dtype, masked, softmax
in float32, cast back to q's dtype, times v. Query head h reads kv head h // (Hq / Hkv), as
transformers' repeat_kv; kv heads are broadcast, never copied. A cache stored in another dtype
(FP8) is upcast to q's dtype as it is read. MLA passes its latent as one kv head (Hkv = 1) with
v_cache a view of k_cache's first Dv columns: then the keys are gathered once, not twice.

Cost: decode gathers [B, W * block_size] keys (W: its group's block-table width), one query each;
prefill runs per sequence in chunks of queries, each against the keys it can see, so its scores
never exceed PREFILL_SCORE_ELEMENTS (_CUDA on a GPU; or one query's row).
"""

from __future__ import annotations

import torch

from gpu_service.kvcache.tensors import read_cache

# per query chunk: Hq x chunk x keys; on the CPU a chunk's scores stay cache-sized (8 MiB fp32)
PREFILL_SCORE_ELEMENTS = 1 << 21
PREFILL_SCORE_ELEMENTS_CUDA = 1 << 26
LOG2E = 1.4426950408889634  # log2(e): base-2 exponentials and log-sum-exps (here, the kernels)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """q [B, Hq, D], caches [S, Hkv, D] / [S, Hkv, Dv], block_table [B, W] int32, kv_len [B]
    int32 (>= 1; the query sits at kv_len - 1) -> [B, Hq, Dv] in q's dtype. Every row gathers
    block_table's whole width of keys. plans: the GPU kernels' (AttentionGroup.plans); this
    reference plans nothing."""
    b, num_heads, head_dim = q.shape
    num_kv_heads, dv = k_cache.shape[1], v_cache.shape[-1]
    pos = torch.arange(block_table.shape[1] * block_size, device=q.device)  # [K]
    slots = block_table[:, pos // block_size].long() * block_size + pos % block_size  # [B, K]
    keys, values = _gather(k_cache, v_cache, slots, q.dtype)  # [B, K, Hkv, D], [B, K, Hkv, Dv]
    last = kv_len.long()[:, None] - 1  # [B, 1]
    allowed = pos[None, :] <= last  # [B, K]
    if window is not None:
        allowed &= pos[None, :] > last - window
    qg = q.reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).mul_(scale)  # [B, Hkv, G, K]
    scores.masked_fill_(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, Hkv, G, Dv]
    return out.reshape(b, num_heads, dv)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] ragged (sequence i: rows cu_seqlens_q[i]:cu_seqlens_q[i + 1], at positions
    kv_len[i] - n_i .. kv_len[i] - 1), block_table [B, W] int32, cu_seqlens_q [B + 1] int32,
    kv_len [B] int32 -> [T, Hq, Dv] in q's dtype. causal=False: every query sees all of its
    sequence's keys. lse: a float32 [T, Hq] that receives each row's log-sum-exp of its scaled
    scores, in base 2 (to merge partial attentions)."""
    if window is not None and not causal:
        raise ValueError("a sliding window is causal: window needs causal=True")
    num_heads = q.shape[1]
    out = q.new_empty((q.shape[0], num_heads, v_cache.shape[-1]))
    starts, lens = cu_seqlens_q.tolist(), kv_len.tolist()
    budget = PREFILL_SCORE_ELEMENTS_CUDA if q.is_cuda else PREFILL_SCORE_ELEMENTS
    for i, length in enumerate(lens):
        q_start, n = starts[i], starts[i + 1] - starts[i]
        first = length - n  # position of the sequence's first query
        chunk = max(1, budget // (num_heads * length))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            lo = 0 if window is None else max(0, first + c0 - window + 1)
            hi = first + c1 if causal else length
            k_pos = torch.arange(lo, hi, device=q.device)  # [K] the keys it can see
            q_pos = torch.arange(first + c0, first + c1, device=q.device)  # [C]
            slots = block_table[i, k_pos // block_size].long() * block_size + k_pos % block_size
            keys, values = _gather(k_cache, v_cache, slots, q.dtype)  # [K, Hkv, D], [K, Hkv, Dv]
            allowed = k_pos[None, :] <= (q_pos[:, None] if causal else length)  # [C, K]
            if window is not None:
                allowed &= k_pos[None, :] > q_pos[:, None] - window
            rows = slice(q_start + c0, q_start + c1)
            row_lse = None if lse is None else lse[rows]
            out[rows] = _attend_rows(q[rows], keys, values, allowed, scale, row_lse)
    return out


def _attend_rows(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 allowed: torch.Tensor, scale: float,
                 lse: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """rows [C, Hq, D] over keys [K, Hkv, D] / values [K, Hkv, Dv] where allowed [C, K]
    -> [C, Hq, Dv] (lse [C, Hq]: set to each row's base-2 log-sum-exp of its scaled scores).
    A kv head's query heads go as rows of one GEMM (its keys never repeated)."""
    c, num_heads, head_dim = rows.shape
    num_kv_heads = keys.shape[1]
    groups = num_heads // num_kv_heads
    qg = rows.reshape(c, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, C, D]
    qg = qg.reshape(num_kv_heads, groups * c, head_dim)
    scores = torch.bmm(qg, keys.permute(1, 2, 0)).mul_(scale)  # [Hkv, G * C, K]
    scores.view(num_kv_heads, groups, c, -1).masked_fill_(~allowed, float("-inf"))
    if lse is not None:
        row_lse = torch.logsumexp(scores.float(), dim=-1) * LOG2E  # [Hkv, G * C]
        lse.copy_(row_lse.view(num_kv_heads, groups, c).permute(2, 0, 1).reshape(c, num_heads))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
    out = torch.bmm(probs, values.permute(1, 0, 2))  # [Hkv, G * C, Dv]
    return out.view(num_kv_heads, groups, c, -1).permute(2, 0, 1, 3).reshape(c, num_heads, -1)


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The keys and values of these slots [*, Hkv, D] / [*, Hkv, Dv], as `dtype`."""
    keys = read_cache(k_cache, slots).to(dtype)
    if is_leading_view(v_cache, k_cache):
        return keys, keys[..., : v_cache.shape[-1]]
    return keys, read_cache(v_cache, slots).to(dtype)


def is_leading_view(v_cache: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether v_cache is k_cache's first columns (MLA's values: the latent without its rope)."""
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.shape[:-1] == k_cache.shape[:-1]
        and v_cache.stride() == k_cache.stride()
        and v_cache.shape[-1] <= k_cache.shape[-1]
    )
