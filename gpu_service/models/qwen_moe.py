"""Qwen3-MoE and Qwen2-MoE: GQA attention with RoPE, softmax top-k MoE.

Qwen3-MoE: RMSNorm on each head of q and k before RoPE, optional attention_bias (q/k/v/o), no
shared expert. Qwen2-MoE: q/k/v bias (qkv_bias), a shared expert scaled per token by
sigmoid(shared_expert_gate(x)). Both: MoE on layers not in mlp_only_layers with
(i + 1) % decoder_sparse_step == 0 (spec.moe_layers), dense MLP elsewhere; router logits in the
model dtype, softmax in float32, top-k, optional renorm (norm_topk_prob), weights rounded to the
model dtype as transformers does. Sliding window only when use_sliding_window (Qwen2: on the
layers that layer_types marks "sliding_attention").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.gqa import GQAAttention
from gpu_service.experts.routed import RoutedExperts
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.tensors import KVCacheTensors
from gpu_service.layers.blocks import DenseMLP, Linear, RMSNorm
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.moe import MoE, SoftmaxRouter
from gpu_service.layers.parallel import RowParallelLinear
from gpu_service.layers.rope import RopeConfig, Rotary
from gpu_service.models.config import BaseConfig
from gpu_service.models.model import CausalLM, DecoderLayer
from ktserve.checkpoint import HFConfig, ModelSpec


@dataclass(frozen=True)
class QwenMoeConfig:
    base: BaseConfig
    qwen3: bool
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    qkv_bias: bool
    o_bias: bool
    windows: tuple[int | None, ...]  # per layer
    rope: RopeConfig

    @classmethod
    def from_hf(cls, hf: HFConfig, spec: ModelSpec) -> QwenMoeConfig:
        base = BaseConfig.from_hf(hf)
        qwen3 = hf.model_type == "qwen3_moe"
        head_dim = hf.int("head_dim", base.hidden_size // base.num_heads)
        window = hf.int("sliding_window") if hf.bool("use_sliding_window", False) else None
        layer_types = hf.data.get("layer_types") or []
        windows = tuple(
            window
            if qwen3 or (i < len(layer_types) and layer_types[i] == "sliding_attention")
            else None
            for i in range(base.num_layers)
        )
        attention_bias = hf.bool("attention_bias", False)
        return cls(
            base=base,
            qwen3=qwen3,
            num_kv_heads=hf.int("num_key_value_heads", base.num_heads),
            head_dim=head_dim,
            intermediate_size=hf.int("intermediate_size"),
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=(
                0 if qwen3 else hf.int("shared_expert_intermediate_size", 0, minimum=0)
            ),
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            norm_topk_prob=hf.bool("norm_topk_prob", False),
            moe_layers=spec.moe_layers,
            qkv_bias=attention_bias if qwen3 else hf.bool("qkv_bias", True),
            o_bias=attention_bias if qwen3 else False,
            windows=windows,
            rope=RopeConfig.from_hf(hf, head_dim),
        )


def load_gqa(
    loader: WeightLoader,
    layer: int,
    base: BaseConfig,
    num_kv_heads: int,
    head_dim: int,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    window: int | None = None,
    backend: AttentionBackend,
    rotary_dim: int | None = None,
) -> GQAAttention:
    """The `model.layers.{layer}.self_attn` GQA block (also Mixtral's and GLM-4.5's): with tensor
    parallelism (loader.tp) the rank's share of the query heads and the kv heads they use.
    rotary_dim: the rotated dims of each head (None: all)."""
    p, hidden, heads = f"model.layers.{layer}.self_attn", base.hidden_size, base.num_heads
    tp = loader.tp
    q_norm = k_norm = None
    if qk_norm:
        fused = backend.fused_kernels
        q_norm = RMSNorm.load(loader, f"{p}.q_norm", head_dim, base.rms_norm_eps,
                              fused_kernels=fused)  # fmt: skip
        k_norm = RMSNorm.load(loader, f"{p}.k_norm", head_dim, base.rms_norm_eps,
                              fused_kernels=fused)  # fmt: skip
    local_kv_heads, kv_shard = tp.kv_heads(num_kv_heads)
    kv_out = num_kv_heads * head_dim
    qkv = [(f"{p}.q_proj", heads * head_dim, tp.column()), (f"{p}.k_proj", kv_out, kv_shard),
           (f"{p}.v_proj", kv_out, kv_shard)]  # fmt: skip
    return GQAAttention(
        layer,
        Linear.load_stacked(loader, qkv, hidden, bias=qkv_bias),
        RowParallelLinear.load(loader, f"{p}.o_proj", heads * head_dim, hidden, bias=o_bias),
        tp.local(heads, "attention heads"),
        local_kv_heads,
        head_dim,
        q_norm,
        k_norm,
        window,
        backend=backend,
        rotary_dim=rotary_dim,
    )


def gqa_cache(
    base: BaseConfig,
    num_kv_heads: int,
    head_dim: int,
    loader: WeightLoader,
    tokens: int,
    block: int,
) -> KVCacheTensors:
    """Keys and values of the rank's kv heads only (loader.tp)."""
    entry = (loader.tp.kv_heads(num_kv_heads)[0], head_dim)
    return KVCacheTensors(
        KVCacheConfig(base.num_layers, (entry, entry), tokens, block), loader.dtype, loader.device
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
    cfg = QwenMoeConfig.from_hf(hf, spec)
    base = cfg.base
    hidden, eps = base.hidden_size, base.rms_norm_eps
    layers = []
    for i in range(base.num_layers):
        p = f"model.layers.{i}"
        if i in cfg.moe_layers:
            router = SoftmaxRouter(
                loader.get(f"{p}.mlp.gate.weight", (cfg.num_experts, hidden)),
                cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                round_to_model_dtype=True,
                fused_kernels=backend.fused_kernels,
            )
            shared = shared_gate = None
            if cfg.shared_expert_intermediate_size:
                inter = cfg.shared_expert_intermediate_size
                shared = DenseMLP.load(loader, f"{p}.mlp.shared_expert", hidden, inter,
                                       reduce=not loader.tp.sharded)  # fmt: skip
                shared_gate = Linear.load(
                    loader, f"{p}.mlp.shared_expert_gate", hidden, 1, quantize=False
                )
            mlp: nn.Module = MoE(i, router, experts, shared, shared_gate, loader.tp)
        else:
            mlp = DenseMLP.load(loader, f"{p}.mlp", hidden, cfg.intermediate_size)
        attn = load_gqa(
            loader,
            i,
            base,
            cfg.num_kv_heads,
            cfg.head_dim,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qwen3,
            window=cfg.windows[i],
            backend=backend,
        )
        layers.append(DecoderLayer.load(loader, i, attn, mlp, hidden, eps, backend))
    kv_cache = gqa_cache(
        base, cfg.num_kv_heads, cfg.head_dim, loader, max_num_tokens_in_cache, block_size
    )
    return CausalLM(base, loader, layers, Rotary(cfg.rope, loader.device), kv_cache, backend)
