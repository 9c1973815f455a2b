"""Batched attention over the paged cache (plain torch), and the GQA attention of Qwen and Mixtral.

`attend` matches transformers' eager attention: (q k^T) * scale, masked, softmax in float32, cast
back to the model dtype, times v. Layouts are described in gpu_service/models/batch.py.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_service.models.batch import StepContext
from gpu_service.models.layers import Linear, RMSNorm
from gpu_service.models.rope import apply_rotary


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: StepContext,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k [B, K, Hkv, D], v [B, K, Hkv, Dv] -> [T, Hq, Dv].

    Query head h reads kv head h // (Hq / Hkv), as transformers' repeat_kv; kv heads are broadcast,
    never copied (MLA passes its compressed latent as one kv head shared by all query heads).
    """
    meta = ctx.meta
    b, q_len = meta.q_index.shape
    num_heads, num_kv_heads = q.shape[1], k.shape[2]
    groups = num_heads // num_kv_heads
    qp = q[meta.q_index].view(b, q_len, num_kv_heads, groups, -1)  # [B, Q, Hkv, G, D]
    qp = qp.permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
    keys = k.permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, K]
    values = v.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, K, Dv]
    scores = torch.matmul(qp, keys) * scale  # [B, Hkv, G, Q, K]
    scores = scores.masked_fill(~ctx.mask(window)[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values)  # [B, Hkv, G, Q, Dv]
    out = out.permute(0, 3, 1, 2, 4).reshape(b, q_len, num_heads, -1)  # [B, Q, Hq, Dv]
    if q_len == 1:  # decode: one query per sequence, none padded (and no host sync)
        return out[:, 0]
    return out[meta.q_valid]  # [T, Hq, Dv]


class GQAAttention(nn.Module):
    """Grouped-query attention with RoPE; optional per-head q/k RMSNorm (Qwen3), qkv bias (Qwen2).

    Cache components of its layer: key [S, Hkv, D], value [S, Hkv, D].
    """

    def __init__(
        self,
        layer: int,
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} kv heads")
        self.layer = layer
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, ctx.cos, ctx.sin, interleaved=False)
        k = apply_rotary(k, ctx.cos, ctx.sin, interleaved=False)
        k_cache, v_cache = ctx.kv_cache.layers[self.layer]  # [S, Hkv, D] each
        k_cache[ctx.meta.slot_mapping] = k
        v_cache[ctx.meta.slot_mapping] = v
        keys, values = k_cache[ctx.meta.kv_slots], v_cache[ctx.meta.kv_slots]  # [B, K, Hkv, D]
        out = attend(q, keys, values, ctx, self.scale, self.window)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, -1))
