"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (`glm4_moe`): GQA attention with partial RoPE and DeepSeek-V3's
sigmoid MoE, as transformers' Glm4Moe computes them.

Attention: q/k/v projections with bias when attention_bias (o_proj never has one), per-head q/k
RMSNorm when use_qk_norm (GLM-4.5 / 4.6; not 4.5-Air), then RoPE on each head's first
head_dim x partial_rotary_factor dims only (by halves; the rest passes through; the factor
defaults to 0.5 as transformers' does). MoE on layers i >= first_k_dense_replace (dense MLP
before): GroupedSigmoidRouter (sigmoid scores, e_score_correction_bias for choosing, n_group /
topk_group, norm_topk_prob, routed_scaling_factor) and n_shared_experts shared experts always
added. Checkpoints hold num_nextn_predict_layers multi-token-prediction layers after the
num_hidden_layers decoder layers (model.layers.N...): they are never read here, nor by the
expert service (ModelSpec's moe_layers stop at num_hidden_layers); they are left for
speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gpu_service.attention.backend import AttentionBackend
from gpu_service.experts.routed import RoutedExperts
from gpu_service.layers.blocks import DenseMLP
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.moe import GroupedSigmoidRouter, MoE
from gpu_service.layers.rope import RopeConfig, Rotary
from gpu_service.models.config import BaseConfig
from gpu_service.models.model import CausalLM, DecoderLayer
from gpu_service.models.qwen_moe import gqa_cache, load_gqa
from ktserve.checkpoint import HFConfig, InvalidConfig, ModelSpec

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig default


@dataclass(frozen=True)
class Glm4MoeConfig:
    base: BaseConfig
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_layers: tuple[int, ...]
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig

    def __post_init__(self) -> None:
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise InvalidConfig(
                self.base.model_type,
                f"partial rotary dim {self.rotary_dim} must be even and in (0, {self.head_dim}]",
            )

    @classmethod
    def from_hf(cls, hf: HFConfig, spec: ModelSpec) -> Glm4MoeConfig:
        base = BaseConfig.from_hf(hf)
        head_dim = hf.int("head_dim", base.hidden_size // base.num_heads)
        params = hf.dict("rope_parameters") or hf.dict("rope_scaling")
        factor = params.get("partial_rotary_factor")
        if factor is None:
            factor = hf.float("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
        rotary_dim = int(head_dim * float(factor))
        return cls(
            base=base,
            num_kv_heads=hf.int("num_key_value_heads", base.num_heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            intermediate_size=hf.int("intermediate_size"),
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            num_shared_experts=hf.int("n_shared_experts", 1, minimum=0),
            moe_layers=spec.moe_layers,
            num_groups=hf.int("n_group", 1),
            topk_groups=hf.int("topk_group", 1),
            norm_topk_prob=hf.bool("norm_topk_prob", True),
            routed_scaling_factor=hf.float("routed_scaling_factor", 1.0),
            attention_bias=hf.bool("attention_bias", False),
            qk_norm=hf.bool("use_qk_norm", False),
            rope=RopeConfig.from_hf(hf, rotary_dim),
        )


def _moe(cfg: Glm4MoeConfig, loader: WeightLoader, layer: int, experts: RoutedExperts,
         backend: AttentionBackend) -> MoE:  # fmt: skip
    p, hidden, num = f"model.layers.{layer}.mlp", cfg.base.hidden_size, cfg.num_experts
    router = GroupedSigmoidRouter(
        loader.get(f"{p}.gate.weight", (num, hidden), torch.float32),
        loader.get(f"{p}.gate.e_score_correction_bias", (num,), torch.float32),
        cfg.num_experts_per_tok,
        cfg.num_groups,
        cfg.topk_groups,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
        fused_kernels=backend.fused_kernels,
    )
    shared = None
    if cfg.num_shared_experts:
        inter = cfg.moe_intermediate_size * cfg.num_shared_experts
        shared = DenseMLP.load(loader, f"{p}.shared_experts", hidden, inter,
                               reduce=not loader.tp.sharded)  # fmt: skip
    return MoE(layer, router, experts, shared, tp=loader.tp)


def build(
    hf: HFConfig,
    spec: ModelSpec,
    loader: WeightLoader,
    experts: RoutedExperts,
    max_num_tokens_in_cache: int,
    block_size: int,
    backend: AttentionBackend,
) -> CausalLM:
    cfg = Glm4MoeConfig.from_hf(hf, spec)
    base = cfg.base
    hidden, eps = base.hidden_size, base.rms_norm_eps
    layers = []
    for i in range(base.num_layers):  # NOTE: stops before the MTP layers
        if i in cfg.moe_layers:
            mlp: nn.Module = _moe(cfg, loader, i, experts, backend)
        else:
            mlp = DenseMLP.load(loader, f"model.layers.{i}.mlp", hidden, cfg.intermediate_size)
        attn = load_gqa(
            loader,
            i,
            base,
            cfg.num_kv_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            backend=backend,
            rotary_dim=cfg.rotary_dim,
        )
        layers.append(DecoderLayer.load(loader, i, attn, mlp, hidden, eps, backend))
    kv_cache = gqa_cache(
        base, cfg.num_kv_heads, cfg.head_dim, loader, max_num_tokens_in_cache, block_size
    )
    return CausalLM(base, loader, layers, Rotary(cfg.rope, loader.device), kv_cache, backend)
