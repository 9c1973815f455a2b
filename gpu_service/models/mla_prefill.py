"""MLA prefill over expanded keys: a prompt chunk attends to its visible latent rows decompressed
per head, as transformers computes MLA, instead of to the absorbed latent.

Per query-key pair the absorbed form (deepseek.py) multiplies over the latent twice, scores over
[c | k_rot] and values c: h * (2r + rope) multiply-adds; the expanded form over
[k_nope | k_rot] and v: h * (nope + rope + v), after decompressing each visible key once,
k_nope = W_uk c and v = W_uv c (r * h * (nope + v) per key). A chunk of n queries is cheaper
expanded when n * (2r - nope - v) > r * (nope + v): above 171 queries at DeepSeek-V3's shapes
(r 512, nope 128, v 128; 2.4x fewer FLOPs at 1,024), 64 at the demo model's. Decode rows stay
absorbed.

The keys are expanded a block at a time (EXPANDED_BLOCK_BYTES of keys and values per block, so
the transient memory is bounded at any context) and the blocks' partial softmaxes merged in float32
(online softmax). On CUDA a context that fits one block goes through the Triton prefill kernel
(attention_triton: multi-head, D = nope + rope, Dv = v) over the expanded block as a one-block
cache; elsewhere torch: (q k^T) * scale in q's dtype, masked, exp in float32, p cast to q's dtype
times v (transformers' rounding where the context fits one block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gpu_service.models.kv_cache import read_cache

if TYPE_CHECKING:
    from gpu_service.models.batch import AttentionGroup

EXPANDED_BLOCK_BYTES = 512 << 20  # NOTE: transient, within the memory plan's headroom
SCORE_ELEMENTS = 1 << 21  # per query chunk x key block: heads x queries x keys (as the reference)
SCORE_ELEMENTS_CUDA = 1 << 26


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
    kernel: Callable | None = None,
    block_bytes: int = EXPANDED_BLOCK_BYTES,
) -> torch.Tensor:
    """q_nope [n, h, nope] and q_rot [n, h, rope] (the group's rows, roped), cache [S, r + rope]
    (latent c, then k_rot), w_uk [h, nope, r], w_uv [h, v, r] -> [n, h, v] in q's dtype.
    kernel: attention_triton.paged_prefill where it runs (CUDA), else None (torch)."""
    heads, nope, rank = w_uk.shape
    v_dim = w_uv.shape[1]
    out = q_nope.new_empty((q_nope.shape[0], heads, v_dim))
    starts = group.cu_seqlens_q.tolist()
    lengths = group.kv_len.tolist()
    rope = q_rot.shape[-1]
    per_key = heads * (2 * nope + rope + v_dim) * q_nope.element_size()  # k_nope, keys, values
    key_block = max(block_size, block_bytes // per_key)
    for i, length in enumerate(lengths):
        rows = slice(starts[i], starts[i + 1])
        n = rows.stop - rows.start
        table = group.block_table[i]
        if kernel is not None and length <= key_block:
            keys, values = _expand(cache, table, 0, length, block_size, w_uk, w_uv, q_nope.dtype)
            out[rows] = _one_block_kernel(kernel, q_nope[rows], q_rot[rows], keys, values, scale)
            continue
        out[rows] = _blockwise(q_nope[rows], q_rot[rows], cache, table, length - n, length,
                               block_size, key_block, w_uk, w_uv, scale)  # fmt: skip
    return out


def _expand(
    cache: torch.Tensor,
    table: torch.Tensor,
    k0: int,
    k1: int,
    block_size: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [K, h, nope + rope] and values [K, h, v] of positions k0 .. k1 - 1."""
    heads, nope, rank = w_uk.shape
    pos = torch.arange(k0, k1, device=cache.device)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    c, k_rot = read_cache(cache, slots).to(dtype).split([rank, cache.shape[-1] - rank], dim=-1)
    k_nope = (c @ w_uk.reshape(heads * nope, rank).T).view(-1, heads, nope)  # [K, h, nope]
    values = (c @ w_uv.reshape(-1, rank).T).view(len(pos), heads, -1)  # [K, h, v]
    keys = torch.cat((k_nope, k_rot[:, None, :].expand(-1, heads, -1)), dim=-1)
    return keys, values


def _one_block_kernel(
    kernel: Callable,
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The sequence's whole context as a one-block cache: slot = position."""
    n, length = q_nope.shape[0], keys.shape[0]
    device = keys.device
    table = torch.zeros((1, 1), dtype=torch.int32, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    kv_len = torch.tensor([length], dtype=torch.int32, device=device)
    q = torch.cat((q_nope, q_rot), dim=-1)  # [n, h, nope + rope]
    return kernel(q, keys, values, table, cu, kv_len, length, scale)


def _blockwise(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    first: int,
    length: int,
    block_size: int,
    key_block: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's queries at positions first .. length - 1, causal, in torch: key blocks
    expanded one at a time, query chunks bounded by the score budget, online softmax."""
    n, heads = q_nope.shape[:2]
    dtype, device = q_nope.dtype, q_nope.device
    q = torch.cat((q_nope, q_rot), dim=-1).transpose(0, 1)  # [h, n, D]
    budget = SCORE_ELEMENTS_CUDA if q.is_cuda else SCORE_ELEMENTS
    v_dim = w_uv.shape[1]
    acc = torch.zeros((heads, n, v_dim), dtype=torch.float32, device=device)
    row_max = torch.full((heads, n, 1), float("-inf"), dtype=torch.float32, device=device)
    row_sum = torch.zeros((heads, n, 1), dtype=torch.float32, device=device)
    q_pos = torch.arange(first, length, device=device)  # [n]
    for k0 in range(0, length, key_block):
        k1 = min(length, k0 + key_block)
        keys, values = _expand(cache, table, k0, k1, block_size, w_uk, w_uv, dtype)
        keys, values = keys.permute(1, 2, 0), values.transpose(0, 1)  # [h, D, K], [h, K, v]
        k_pos = torch.arange(k0, k1, device=device)
        chunk = max(1, budget // (heads * (k1 - k0)))
        for c0 in range(max(0, k0 - first), n, chunk):  # NOTE: rows before k0 see none of it
            c = slice(c0, min(n, c0 + chunk))
            scores = torch.bmm(q[:, c], keys).mul_(scale).float()  # [h, C, K]
            scores.masked_fill_(k_pos[None, None, :] > q_pos[c][None, :, None], float("-inf"))
            new_max = torch.maximum(row_max[:, c], scores.amax(dim=-1, keepdim=True))
            probs = torch.exp(scores.sub_(new_max))  # [h, C, K]
            rescale = torch.exp(row_max[:, c] - new_max)  # 0 where the row saw no key yet
            row_sum[:, c] = row_sum[:, c] * rescale + probs.sum(dim=-1, keepdim=True)
            acc[:, c] = acc[:, c] * rescale + torch.bmm(probs.to(dtype), values).float()
            row_max[:, c] = new_max
    return (acc / row_sum).to(dtype).transpose(0, 1)  # [n, h, v]
