"""Paged attention, naively, in float64: the oracle of the attention kernels and of the
benchmark's torch reference."""

from __future__ import annotations

import torch


def reference(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_len, block_size, scale, window):
    """float64 attention of each sequence's queries over its own cached keys -> [T, Hq, Dv]."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    outs = []
    for i in range(kv_len.shape[0]):
        start, end, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(kv_len[i])
        key_pos = torch.arange(n)
        slots = block_table[i].long()[key_pos // block_size] * block_size + key_pos % block_size
        keys = k_cache[slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = v_cache[slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        query_pos = torch.arange(n - (end - start), n)
        visible = key_pos[None, :] <= query_pos[:, None]  # [Q, K]
        if window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outs)
