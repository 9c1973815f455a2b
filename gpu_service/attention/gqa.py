"""The GQA attention of Qwen and Mixtral, over the paged cache (paged_attention.py)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import StepContext
from gpu_service.kvcache.tensors import write_cache
from gpu_service.layers import fused_ops
from gpu_service.layers.blocks import Linear, RMSNorm
from gpu_service.layers.rope import apply_rotary


class GQAAttention(nn.Module):
    """Grouped-query attention with RoPE; optional per-head q/k RMSNorm (Qwen3, GLM-4.5), qkv bias
    (Qwen2, GLM-4.5), partial rotary (GLM-4.5: rotary_dim < head_dim, only each head's first
    rotary_dim dims rotated, by halves).

    Cache components of its layer: key [S, Hkv, D], value [S, Hkv, D]. Its kernels: the model's
    AttentionBackend (fused_ops where backend.fused_kernels and they apply).
    """

    def __init__(
        self,
        layer: int,
        qkv_proj: Linear,
        o_proj: Linear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        window: int | None = None,
        *,
        backend: AttentionBackend,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} kv heads")
        self.layer = layer
        self.qkv_proj, self.o_proj = qkv_proj, o_proj  # qkv: q_proj, k_proj, v_proj stacked
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} is not in (0, {head_dim}]")
        self.backend = backend
        self.scale = head_dim**-0.5
        self._qkv_split = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        # the fused kernel takes one eps for both norms and rotates whole heads
        self._fusable = self.rotary_dim == head_dim and (
            q_norm is None or (k_norm is not None and q_norm.eps == k_norm.eps)
        )

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self._qkv_split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = ctx.kv_cache.layers[self.layer]  # [S, Hkv, D] each
        q = self._norm_rope_and_cache(q, k, v, k_cache, v_cache, ctx)
        out = self.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale, self.window)
        return self.o_proj(out.reshape(t, -1))

    def _norm_rope_and_cache(self, q, k, v, k_cache, v_cache, ctx: StepContext) -> torch.Tensor:
        """q/k per-head RMSNorm (Qwen3), RoPE, k and v into the cache -> the rotated q; one fused
        kernel where it applies (fused_ops.qk_rope_cache), else the torch code (its oracle)."""
        q_norm, k_norm = self.q_norm, self.k_norm
        weights = (
            (None, None) if q_norm is None or k_norm is None else (q_norm.weight, k_norm.weight)
        )
        fused = self.backend.fused_kernels
        if (
            fused
            and self._fusable
            and fused_ops.qk_rope_cache_fits(q, k, v, k_cache, v_cache, ctx.cos, ctx.sin, weights)
        ):
            eps = 0.0 if q_norm is None else q_norm.eps
            return fused_ops.qk_rope_cache(q, k, v, *weights, eps, ctx.cos, ctx.sin, k_cache,
                                           v_cache, ctx.meta.slot_mapping)  # fmt: skip
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, ctx, fused), self._rotate(k, ctx, fused)
        write_cache(k_cache, ctx.meta.slot_mapping, k)
        write_cache(v_cache, ctx.meta.slot_mapping, v)
        return q

    def _rotate(self, x: torch.Tensor, ctx: StepContext, fused: bool) -> torch.Tensor:
        """x [T, heads, D] with its first rotary_dim dims of each head rotated (by halves)."""
        rot = self.rotary_dim
        if rot == self.head_dim:
            return apply_rotary(x, ctx.cos, ctx.sin, interleaved=False, fused=fused)
        rotated = apply_rotary(x[..., :rot], ctx.cos, ctx.sin, interleaved=False, fused=fused)
        return torch.cat((rotated, x[..., rot:]), dim=-1)
