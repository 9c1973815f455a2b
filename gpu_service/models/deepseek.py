"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeek MoE.

MLA per token: q = q_b(norm(q_a(x))) (or q_proj(x) without q_lora_rank), split per head into
[q_nope | q_rot]; the compressed kv = kv_a(x) = [c (kv_lora_rank) | k_rot (qk_rope_head_dim)], c is
RMS-normalized, k_rot roped (one head shared by all heads). The cache holds [c | k_rot] per token.
transformers expands keys/values per head (kv_b(c) = [k_nope | v]); we absorb kv_b instead, with
W_uk [h, nope, r] and W_uv [h, v, r] its two halves (same math, reassociated):
    q_nope . k_nope = (W_uk^T q_nope) . c    -> queries [W_uk^T q_nope | q_rot] vs keys [c | k_rot]
    sum_k p_k v_k   = W_uv (sum_k p_k c_k)   -> values are c; W_uv applied once per query
so attention is MQA with one (kv_lora_rank + rope)-wide kv head and nothing per head is built for
the cached tokens. Prompt chunks long enough that expanding costs fewer FLOPs (above ~171 queries
a sequence at DeepSeek-V3's shapes) attend to the keys expanded instead, on CUDA
(mla_prefill.py).
Tensor parallelism (parallel.py) splits the heads: q_b (or q_proj), kv_b's W_uk / W_uv and
o_proj's inputs per head; q_a, kv_a and the latent cache are replicated, since the
latent is one kv head every query head reads (splitting it would cost an all-gather per layer to
save (kv_lora_rank + rope) values per token and layer). Softmax scale: qk_head_dim^-0.5, times
YaRN's mscale(factor, mscale_all_dim)^2 when the config asks for YaRN.

MoE layers (spec.moe_layers: i >= first_k_dense_replace and i % moe_layer_freq == 0) route with
GroupedSigmoidRouter (V3) or SoftmaxRouter (V2) and add n_shared_experts shared experts.
NOTE: transformers 5.24 ignores norm_topk_prob for V2; DeepSeek's own V2 code applies it, as we do
(released V2 checkpoints set it false, so both agree on them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import StepContext, num_rows
from gpu_service.attention.mla_prefill import expanded_prefill, worth_expanding
from gpu_service.experts.routed import RoutedExperts
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.tensors import KVCacheTensors, write_cache
from gpu_service.layers import fused_ops
from gpu_service.layers.blocks import DenseMLP, Linear, RMSNorm
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.moe import GroupedSigmoidRouter, MoE, SoftmaxRouter
from gpu_service.layers.parallel import RowParallelLinear
from gpu_service.layers.rope import RopeConfig, Rotary, apply_rotary
from gpu_service.models.config import BaseConfig
from gpu_service.models.model import CausalLM, DecoderLayer
from ktserve.checkpoint import HFConfig, InvalidConfig, ModelSpec

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekConfig:
    base: BaseConfig
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_layers: tuple[int, ...]
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    topk_method: str  # "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2)
    num_groups: int | None
    topk_groups: int | None
    attention_bias: bool
    mlp_bias: bool
    rope: RopeConfig

    def __post_init__(self) -> None:
        grouped = self.topk_method in ("noaux_tc", "group_limited_greedy")
        if grouped and not (self.num_groups and self.topk_groups):
            raise InvalidConfig(
                self.base.model_type, f"{self.topk_method} needs n_group and topk_group"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: HFConfig, spec: ModelSpec) -> DeepseekConfig:
        v3 = hf.model_type == "deepseek_v3"
        topk_method = "noaux_tc" if v3 else hf.str("topk_method", "greedy")
        if not v3 and topk_method not in V2_TOPK_METHODS:
            raise InvalidConfig(
                hf.source, f"topk_method {topk_method!r} is not one of {', '.join(V2_TOPK_METHODS)}"
            )
        rope_dim = hf.int("qk_rope_head_dim")
        interleaved = hf.bool("rope_interleave", True) if v3 else True
        return cls(
            base=BaseConfig.from_hf(hf),
            intermediate_size=hf.int("intermediate_size"),
            moe_intermediate_size=hf.int("moe_intermediate_size"),
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            num_shared_experts=hf.int("n_shared_experts", 0, minimum=0),
            moe_layers=spec.moe_layers,
            q_lora_rank=hf.opt_int("q_lora_rank"),
            kv_lora_rank=hf.int("kv_lora_rank"),
            qk_nope_head_dim=hf.int("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=hf.int("v_head_dim"),
            routed_scaling_factor=hf.float("routed_scaling_factor", 2.5 if v3 else 1.0),
            norm_topk_prob=hf.bool("norm_topk_prob", v3),
            topk_method=topk_method,
            num_groups=hf.opt_int("n_group"),
            topk_groups=hf.opt_int("topk_group"),
            attention_bias=hf.bool("attention_bias", False),
            mlp_bias=hf.bool("mlp_bias", False),
            rope=RopeConfig.from_hf(hf, rope_dim, interleaved=interleaved),
        )


class MLAttention(nn.Module):
    """Its kernels: the model's AttentionBackend (fused_ops where backend.fused_kernels and they
    apply)."""

    def __init__(self, cfg: DeepseekConfig, loader: WeightLoader, layer: int,
                 backend: AttentionBackend) -> None:  # fmt: skip
        super().__init__()
        self.backend = backend
        fused = backend.fused_kernels
        p, hidden, heads = (
            f"model.layers.{layer}.self_attn",
            cfg.base.hidden_size,
            cfg.base.num_heads,
        )
        bias, tp = cfg.attention_bias, loader.tp
        self.cfg, self.layer, self.num_heads = cfg, layer, tp.local(heads, "attention heads")
        q_out = heads * cfg.qk_head_dim
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        kv_a = f"{p}.kv_a_proj_with_mqa"
        if cfg.q_lora_rank is None:
            self.q_proj = Linear.load(loader, f"{p}.q_proj", hidden, q_out, shard=tp.column())
            self.kv_a_proj = Linear.load(loader, kv_a, hidden, latent, bias=bias)
        else:
            # NOTE: q_a and kv_a read the same x: one GEMM, [T, q_lora_rank + latent]
            parts = [(f"{p}.q_a_proj", cfg.q_lora_rank, None), (kv_a, latent, None)]
            self.qkv_a_proj = Linear.load_stacked(loader, parts, hidden, bias=bias)
            self.q_a_norm = RMSNorm.load(loader, f"{p}.q_a_layernorm", cfg.q_lora_rank, 1e-6,
                                         fused_kernels=fused)  # fmt: skip
            self.q_b_proj = Linear.load(loader, f"{p}.q_b_proj", cfg.q_lora_rank, q_out,
                                        shard=tp.column())  # fmt: skip
        self.kv_a_norm = RMSNorm.load(loader, f"{p}.kv_a_layernorm", cfg.kv_lora_rank, 1e-6,
                                      fused_kernels=fused)  # fmt: skip
        kv_out = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        kv_b = loader.get(f"{p}.kv_b_proj.weight", (kv_out, cfg.kv_lora_rank), shard=tp.column())
        kv_b = kv_b.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        self.register_buffer("w_uk", w_uk.contiguous())  # [h, nope, r]
        self.register_buffer("w_uv", w_uv.contiguous())  # [h, v, r]
        self.o_proj = RowParallelLinear.load(loader, f"{p}.o_proj", heads * cfg.v_head_dim,
                                             hidden, bias=bias)  # fmt: skip
        self.scale = cfg.qk_head_dim**-0.5 * cfg.rope.softmax_scale_multiplier

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cfg, t, heads = self.cfg, x.shape[0], self.num_heads
        nope, rope, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q, kv_a = self.q_proj(x), self.kv_a_proj(x)
        else:
            q_a, kv_a = self.qkv_a_proj(x).split([cfg.q_lora_rank, rank + rope], dim=-1)
            q = self.q_b_proj(self.q_a_norm(q_a))
        q_nope, q_rot = q.view(t, heads, nope + rope).split([nope, rope], dim=-1)  # [T, h, *]
        (cache,) = ctx.kv_cache.layers[self.layer]  # [S, r + rope]
        meta, norm, backend = ctx.meta, self.kv_a_norm, self.backend
        fused = backend.fused_kernels and fused_ops.mla_rope_cache_fits(
            q_rot, kv_a, norm.weight, cache, ctx.cos, ctx.sin
        )
        if fused:
            q_rot = fused_ops.mla_rope_cache(q_rot, kv_a, norm.weight, norm.eps, ctx.cos,
                                             ctx.sin, cache, meta.slot_mapping,
                                             cfg.rope.interleaved)  # fmt: skip
        else:
            c, k_rot = kv_a.split([rank, rope], dim=-1)  # [T, r], [T, rope]
            rotate = partial(
                apply_rotary,
                cos=ctx.cos,
                sin=ctx.sin,
                interleaved=cfg.rope.interleaved,
                fused=backend.fused_kernels,
            )
            q_rot = rotate(q_rot)
            k_rot = rotate(k_rot[:, None, :])[:, 0]  # [T, rope]
            write_cache(cache, meta.slot_mapping, torch.cat((norm(c), k_rot), dim=-1))
        prefill, kernel = meta.prefill, backend.expanded_prefill_kernel()
        per_seq = 0 if prefill is None else num_rows(prefill.rows) // len(prefill.kv_len)
        w_uk, w_uv, scale = self.w_uk, self.w_uv, self.scale
        if kernel is None or not worth_expanding(per_seq, rank, nope, cfg.v_head_dim):
            out = absorbed_attention(q_nope, q_rot, cache, w_uk, w_uv,
                                     partial(backend.attend, meta=meta, scale=scale))  # fmt: skip
        else:  # NOTE: the prompt chunks expanded (mla_prefill.py), the decode rows absorbed
            out = q_nope.new_empty((t, heads, cfg.v_head_dim))
            for group in meta.decodes:
                attend = partial(backend.attend_group, group=group, block_size=meta.block_size,
                                 scale=scale, prefill=False)  # fmt: skip
                out[group.rows] = absorbed_attention(q_nope[group.rows], q_rot[group.rows], cache,
                                                     w_uk, w_uv, attend)  # fmt: skip
            out[prefill.rows] = expanded_prefill(
                q_nope[prefill.rows], q_rot[prefill.rows], cache, prefill, meta.block_size,
                w_uk, w_uv, scale, kernel,
            )  # fmt: skip
        return self.o_proj(out.reshape(t, heads * cfg.v_head_dim))


def absorbed_attention(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    attend: Callable,
) -> torch.Tensor:
    """MLA over the latent: q_nope [n, h, nope], q_rot [n, h, rope] (roped), cache [S, r + rope],
    w_uk [h, nope, r], w_uv [h, v, r] -> [n, h, v]; attend(queries, k_cache, v_cache) is a paged
    attention over the latent as one kv head (values its first r columns)."""
    rank = w_uk.shape[-1]
    latent = cache[:, None, :]  # [S, 1, r + rope]
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [n, h, r]
    queries = torch.cat((q_lat, q_rot), dim=-1)  # [n, h, r + rope]
    out = attend(queries, latent, latent[..., :rank])  # [n, h, r]
    return torch.einsum("thr,hvr->thv", out, w_uv)  # [n, h, v]


def _router(
    cfg: DeepseekConfig, loader: WeightLoader, prefix: str, fused_kernels: bool
) -> nn.Module:
    hidden, num = cfg.base.hidden_size, cfg.num_experts
    weight = loader.get(f"{prefix}.weight", (num, hidden), torch.float32)
    if cfg.topk_method == "noaux_tc":
        assert cfg.num_groups is not None and cfg.topk_groups is not None
        return GroupedSigmoidRouter(
            weight,
            loader.get(f"{prefix}.e_score_correction_bias", (num,), torch.float32),
            cfg.num_experts_per_tok,
            cfg.num_groups,
            cfg.topk_groups,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
            fused_kernels=fused_kernels,
        )
    grouped = cfg.topk_method == "group_limited_greedy"
    return SoftmaxRouter(
        weight,
        cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob and cfg.num_experts_per_tok > 1,
        scaling=cfg.routed_scaling_factor,
        logits_fp32=True,
        num_groups=cfg.num_groups if grouped else None,
        topk_groups=cfg.topk_groups if grouped else None,
        fused_kernels=fused_kernels,
    )


def build(
    hf: HFConfig,
    spec: ModelSpec,
    loader: WeightLoader,
    experts: RoutedExperts,
    max_num_tokens_in_cache: int,
    block_size: int,
    backend: AttentionBackend,
) -> CausalLM:
    cfg = DeepseekConfig.from_hf(hf, spec)
    hidden, eps = cfg.base.hidden_size, cfg.base.rms_norm_eps
    layers = []
    for i in range(cfg.base.num_layers):
        p = f"model.layers.{i}"
        if i in cfg.moe_layers:
            shared = None
            if cfg.num_shared_experts:
                inter = cfg.moe_intermediate_size * cfg.num_shared_experts
                shared = DenseMLP.load(loader, f"{p}.mlp.shared_experts", hidden, inter,
                                       reduce=not loader.tp.sharded)  # fmt: skip
            router = _router(cfg, loader, f"{p}.mlp.gate", backend.fused_kernels)
            mlp: nn.Module = MoE(i, router, experts, shared, tp=loader.tp)
        else:
            mlp = DenseMLP.load(
                loader, f"{p}.mlp", hidden, cfg.intermediate_size, bias=cfg.mlp_bias
            )
        attn = MLAttention(cfg, loader, i, backend)
        layers.append(DecoderLayer.load(loader, i, attn, mlp, hidden, eps, backend))
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    kv_config = KVCacheConfig(cfg.base.num_layers, (latent,), max_num_tokens_in_cache, block_size)
    kv_cache = KVCacheTensors(kv_config, loader.dtype, loader.device)
    return CausalLM(cfg.base, loader, layers, Rotary(cfg.rope, loader.device), kv_cache, backend)
