"""The demo model's architecture: a small DeepSeek-V3 (MLA attention, one shared expert, routed
experts with grouped top-k routing, a dense first layer), as a transformers DeepseekV3Config."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import DeepseekV3Config


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 5
    first_k_dense_replace: int = 1
    intermediate_size: int = 768  # the dense layer's MLP
    moe_intermediate_size: int = 64  # each routed expert and the shared expert
    n_routed_experts: int = 32
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 8
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            raise ValueError("each expert group needs >= 2 experts (group score = top-2 sum)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError("topk_group must be in [1, n_group]")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError("num_experts_per_tok exceeds the experts of the selected groups")
        if not 0 < self.first_k_dense_replace < self.num_hidden_layers:
            raise ValueError("need at least one dense and one MoE layer")

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace


def build_config(spec: ModelSpec, eos_token_id: int) -> DeepseekV3Config:
    """DeepseekV3Config for spec; eos (also bos and pad) is the tokenizer's <|endoftext|>."""
    return DeepseekV3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        first_k_dense_replace=spec.first_k_dense_replace,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        n_routed_experts=spec.n_routed_experts,
        n_shared_experts=spec.n_shared_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor,
        norm_topk_prob=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        num_nextn_predict_layers=0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
