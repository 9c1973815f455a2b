"""The GPU part of each family as `serve` loads it, tensor by tensor, from config.json alone:
attention, dense MLPs, shared experts, routers, norms, embedding and head (routed experts and
GLM-4.5's multi-token-prediction layers left out, as the loaders leave them).

kind says how a tensor is stored: "linear" takes --gpu-weight-format; "model" stays in the model
dtype (norms, biases, the embedding, the head, DeepSeek's kv_b_proj, Qwen's router); "fp32"
stays float32 (DeepSeek's and GLM's routers and their correction bias).
"""

from __future__ import annotations

from dataclasses import dataclass

from ktserve.checkpoint import HFConfig, ModelSpec

KINDS = ("linear", "model", "fp32")


@dataclass(frozen=True)
class GPUTensor:
    name: str
    shape: tuple[int, ...]  # [N outputs, K inputs] for a linear
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def num_params(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def gpu_tensors(hf: HFConfig) -> tuple[GPUTensor, ...]:
    """Every tensor the GPU part holds for this config (ModelSpec's checks apply)."""
    spec = ModelSpec.from_hf(hf)
    hidden, vocab = hf.int("hidden_size"), hf.int("vocab_size")
    tensors = [GPUTensor("model.embed_tokens", (vocab, hidden), "model"),
               GPUTensor("model.norm", (hidden,), "model")]  # fmt: skip
    if not hf.bool("tie_word_embeddings", False):
        tensors.append(GPUTensor("lm_head", (vocab, hidden), "model"))
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}"
        tensors += [GPUTensor(f"{p}.input_layernorm", (hidden,), "model"),
                    GPUTensor(f"{p}.post_attention_layernorm", (hidden,), "model")]  # fmt: skip
        if spec.family.startswith("deepseek"):
            tensors += _mla(hf, p, hidden)
        else:
            tensors += _gqa(hf, spec.family, p, hidden)
        if layer in spec.moe_layers:
            tensors += _moe(hf, spec, p, hidden)
        else:
            bias = spec.family.startswith("deepseek") and hf.bool("mlp_bias", False)
            tensors += _mlp(f"{p}.mlp", hidden, hf.int("intermediate_size"), bias)
    return tuple(tensors)


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> list[GPUTensor]:
    out = [GPUTensor(f"{prefix}.gate_proj", (inter, hidden), "linear"),
           GPUTensor(f"{prefix}.up_proj", (inter, hidden), "linear"),
           GPUTensor(f"{prefix}.down_proj", (hidden, inter), "linear")]  # fmt: skip
    if bias:
        sizes = (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden))
        out += [GPUTensor(f"{prefix}.{n}.bias", (d,), "model") for n, d in sizes]
    return out


def _mla(hf: HFConfig, p: str, hidden: int) -> list[GPUTensor]:
    heads = hf.int("num_attention_heads")
    rank, rope = hf.int("kv_lora_rank"), hf.int("qk_rope_head_dim")
    nope, v = hf.int("qk_nope_head_dim"), hf.int("v_head_dim")
    q_out, latent = heads * (nope + rope), rank + rope
    q_lora = hf.opt_int("q_lora_rank")
    a = f"{p}.self_attn"
    if q_lora is None:
        out = [GPUTensor(f"{a}.q_proj", (q_out, hidden), "linear")]
    else:
        out = [GPUTensor(f"{a}.q_a_proj", (q_lora, hidden), "linear"),
               GPUTensor(f"{a}.q_a_layernorm", (q_lora,), "model"),
               GPUTensor(f"{a}.q_b_proj", (q_out, q_lora), "linear")]  # fmt: skip
    out += [GPUTensor(f"{a}.kv_a_proj_with_mqa", (latent, hidden), "linear"),
            GPUTensor(f"{a}.kv_a_layernorm", (rank,), "model"),
            GPUTensor(f"{a}.kv_b_proj", (heads * (nope + v), rank), "model"),
            GPUTensor(f"{a}.o_proj", (hidden, heads * v), "linear")]  # fmt: skip
    if hf.bool("attention_bias", False):
        biased = (("q_a_proj", q_lora), ("kv_a_proj_with_mqa", latent), ("o_proj", hidden))
        if q_lora is None:
            biased = (("kv_a_proj_with_mqa", latent), ("o_proj", hidden))
        out += [GPUTensor(f"{a}.{n}.bias", (d,), "model") for n, d in biased]
    return out


def _gqa(hf: HFConfig, family: str, p: str, hidden: int) -> list[GPUTensor]:
    heads = hf.int("num_attention_heads")
    kv_heads = hf.int("num_key_value_heads", heads)
    head_dim = hf.int("head_dim", hidden // heads)
    qkv_bias, o_bias, qk_norm = _gqa_extras(hf, family)
    a = f"{p}.self_attn"
    q, kv = heads * head_dim, kv_heads * head_dim
    out = [GPUTensor(f"{a}.q_proj", (q, hidden), "linear"),
           GPUTensor(f"{a}.k_proj", (kv, hidden), "linear"),
           GPUTensor(f"{a}.v_proj", (kv, hidden), "linear"),
           GPUTensor(f"{a}.o_proj", (hidden, q), "linear")]  # fmt: skip
    if qkv_bias:
        out += [GPUTensor(f"{a}.{n}.bias", (d,), "model")
                for n, d in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]  # fmt: skip
    if o_bias:
        out.append(GPUTensor(f"{a}.o_proj.bias", (hidden,), "model"))
    if qk_norm:
        out += [GPUTensor(f"{a}.q_norm", (head_dim,), "model"),
                GPUTensor(f"{a}.k_norm", (head_dim,), "model")]  # fmt: skip
    return out


def _gqa_extras(hf: HFConfig, family: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o bias, per-head q/k norms) as each family's loader reads them."""
    if family == "qwen3_moe":
        bias = hf.bool("attention_bias", False)
        return bias, bias, True
    if family == "qwen2_moe":
        return hf.bool("qkv_bias", True), False, False
    if family == "glm4_moe":
        return hf.bool("attention_bias", False), False, hf.bool("use_qk_norm", False)
    return False, False, False  # mixtral


def _moe(hf: HFConfig, spec: ModelSpec, p: str, hidden: int) -> list[GPUTensor]:
    num, inter = spec.num_experts, spec.moe_intermediate_size
    if spec.family in ("deepseek_v3", "deepseek_v2", "glm4_moe"):
        grouped = spec.family != "deepseek_v2"
        out = [GPUTensor(f"{p}.mlp.gate", (num, hidden), "fp32")]
        if grouped:
            out.append(GPUTensor(f"{p}.mlp.gate.e_score_correction_bias", (num,), "fp32"))
        shared = hf.int("n_shared_experts", 1 if spec.family == "glm4_moe" else 0, minimum=0)
        if shared:
            out += _mlp(f"{p}.mlp.shared_experts", hidden, inter * shared)
        return out
    if spec.family == "mixtral":
        return [GPUTensor(f"{p}.block_sparse_moe.gate", (num, hidden), "model")]
    out = [GPUTensor(f"{p}.mlp.gate", (num, hidden), "model")]
    shared_inter = 0
    if spec.family == "qwen2_moe":
        shared_inter = hf.int("shared_expert_intermediate_size", 0, minimum=0)
    if shared_inter:
        out += _mlp(f"{p}.mlp.shared_expert", hidden, shared_inter)
        out.append(GPUTensor(f"{p}.mlp.shared_expert_gate", (1, hidden), "model"))
    return out
