"""Mixtral: GQA attention with RoPE (sliding window when config.sliding_window is set) and a sparse
MoE on every layer: softmax of the router logits in float32, top-k, renormalized; no shared expert.
Experts are block_sparse_moe.experts.E.{w1 (gate), w3 (up), w2 (down)}."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_service.attention.backend import AttentionBackend
from gpu_service.experts.routed import RoutedExperts
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.moe import MoE, SoftmaxRouter
from gpu_service.layers.rope import RopeConfig, Rotary
from gpu_service.models.config import BaseConfig
from gpu_service.models.model import CausalLM, DecoderLayer
from gpu_service.models.qwen_moe import gqa_cache, load_gqa
from ktserve.checkpoint import HFConfig, ModelSpec


@dataclass(frozen=True)
class MixtralConfig:
    base: BaseConfig
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    sliding_window: int | None
    rope: RopeConfig

    @classmethod
    def from_hf(cls, hf: HFConfig, spec: ModelSpec) -> MixtralConfig:
        base = BaseConfig.from_hf(hf)
        head_dim = hf.int("head_dim", base.hidden_size // base.num_heads)
        return cls(
            base=base,
            num_kv_heads=hf.int("num_key_value_heads", base.num_heads),
            head_dim=head_dim,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            sliding_window=hf.opt_int("sliding_window"),
            rope=RopeConfig.from_hf(hf, head_dim),
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
    cfg = MixtralConfig.from_hf(hf, spec)
    base = cfg.base
    hidden, eps = base.hidden_size, base.rms_norm_eps
    layers = []
    for i in range(base.num_layers):
        p = f"model.layers.{i}"
        router = SoftmaxRouter(
            loader.get(f"{p}.block_sparse_moe.gate.weight", (cfg.num_experts, hidden)),
            cfg.num_experts_per_tok,
            norm_topk_prob=True,
            fused_kernels=backend.fused_kernels,
        )
        attn = load_gqa(loader, i, base, cfg.num_kv_heads, cfg.head_dim,
                        window=cfg.sliding_window, backend=backend)  # fmt: skip
        moe = MoE(i, router, experts, tp=loader.tp)
        layers.append(DecoderLayer.load(loader, i, attn, moe, hidden, eps, backend))
    kv_cache = gqa_cache(
        base, cfg.num_kv_heads, cfg.head_dim, loader, max_num_tokens_in_cache, block_size
    )
    return CausalLM(base, loader, layers, Rotary(cfg.rope, loader.device), kv_cache, backend)
