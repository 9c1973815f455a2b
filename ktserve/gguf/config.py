"""The Hugging Face config.json a GGUF checkpoint's metadata describes (`<arch>.*` keys), so the
families build their configs from it as they do from a checkpoint directory's config.json.

Per architecture: deepseek2 -> deepseek_v3 (sigmoid gating) or deepseek_v2, qwen3moe ->
qwen3_moe, qwen2moe -> qwen2_moe, llama with experts -> mixtral. What GGUF metadata does not say
is read from the tensors: the vocabulary (token_embd rows), tied embeddings (no output.weight),
attention biases, and which layers are dense (no ffn_gate_inp) for the Qwen families.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ktserve.checkpoint.errors import NotAnMoEModel
from ktserve.gguf.container import GGUFCheckpoint
from ktserve.gguf.errors import (
    GGUFTensorShapeMismatch,
    MissingGGUFKey,
    UnsupportedGGUFArchitecture,
)

SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
YARN_LOG_MUL_SCALE = 0.1  # deepseek2's rope.scaling.yarn_log_multiplier is 0.1 x mscale_all_dim
_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


def as_written(value: float) -> float:
    """A float32 metadata value as the converter's source wrote it (1e-05, not 9.99999974e-06):
    the shortest decimal that is the same float32."""
    return float(str(np.float32(value)))


class Metadata:
    """`<arch>.*` keys of one checkpoint, read with clear errors."""

    def __init__(self, checkpoint: GGUFCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.arch = checkpoint.architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.checkpoint.value(f"{self.arch}.{key}", default)

    def int(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # NOTE: some converters write a per-layer array of one value
        if not isinstance(value, int) or isinstance(value, bool):
            found = f"an integer; found {value!r}" if value is not None else ""
            raise MissingGGUFKey(self.checkpoint.path, f"{self.arch}.{key}", found)
        return value

    def tensor_rows(self, name: str) -> int:
        return self.checkpoint.shape(name)[0]

    def moe_layers(self) -> list[int]:
        return sorted(int(m[1]) for n in self.checkpoint.tensors if (m := _ROUTER.match(n)))


def _common(meta: Metadata, model_type: str) -> dict[str, Any]:
    ckpt = meta.checkpoint
    heads = meta.int("attention.head_count")
    config = {
        "model_type": model_type,
        "vocab_size": meta.tensor_rows("token_embd.weight"),
        "hidden_size": meta.int("embedding_length"),
        "num_hidden_layers": meta.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        "rms_norm_eps": as_written(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": as_written(meta.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.int("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in ckpt.tensors,
        "num_experts_per_tok": meta.int("expert_used_count"),
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = ckpt.value(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = value
    rope_scaling = _rope_scaling(meta)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta: Metadata) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = as_written(meta.get("rope.scaling.factor", 1.0))
    scaling: dict[str, Any] = {"type": kind, "rope_type": kind, "factor": factor}
    original = meta.get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    log_mul = meta.get("rope.scaling.yarn_log_multiplier")
    if kind == "yarn" and meta.arch == "deepseek2" and log_mul:
        scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / YARN_LOG_MUL_SCALE
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if meta.get(f"rope.scaling.{key}") is not None:
            scaling[hf] = float(meta.get(f"rope.scaling.{key}"))
    return scaling


def _deepseek2(meta: Metadata) -> dict[str, Any]:
    ckpt = meta.checkpoint
    sigmoid = meta.get("expert_gating_func") == SIGMOID_GATING or any(
        n.endswith("exp_probs_b.bias") for n in ckpt.tensors
    )
    config = _common(meta, "deepseek_v3" if sigmoid else "deepseek_v2")
    rope = meta.int("rope.dimension_count")
    key_length = meta.int("attention.key_length_mla", meta.get("attention.key_length"))
    groups = meta.get("expert_group_count")
    config.update({
        "num_key_value_heads": config["num_attention_heads"],  # NOTE: MLA; the file says 1 (MQA)
        "intermediate_size": meta.int("feed_forward_length"),
        "moe_intermediate_size": meta.int("expert_feed_forward_length"),
        "n_routed_experts": meta.int("expert_count"),
        "n_shared_experts": meta.int("expert_shared_count", 0),
        "first_k_dense_replace": meta.int("leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "q_lora_rank": meta.get("attention.q_lora_rank"),
        "kv_lora_rank": meta.int("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key_length - rope,
        "v_head_dim": meta.int("attention.value_length_mla", meta.get("attention.value_length")),
        "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": meta.get("expert_group_used_count"),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
    })  # fmt: skip
    if not sigmoid:
        config["topk_method"] = "group_limited_greedy" if (groups or 1) > 1 else "greedy"
    return config


def _qwen_moe(meta: Metadata, qwen3: bool) -> dict[str, Any]:
    ckpt = meta.checkpoint
    config = _common(meta, "qwen3_moe" if qwen3 else "qwen2_moe")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    moe_layers = set(meta.moe_layers())
    config.update({
        "head_dim": meta.int("attention.key_length", hidden // heads),
        "intermediate_size": meta.int("feed_forward_length", 0),
        "moe_intermediate_size": meta.int("expert_feed_forward_length"),
        "num_experts": meta.int("expert_count"),
        # NOTE: llama.cpp makes every layer MoE; a layer without a router is dense here
        "mlp_only_layers": [i for i in range(config["num_hidden_layers"]) if i not in moe_layers],
        "decoder_sparse_step": 1,
        # NOTE: llama.cpp's qwen3moe always normalizes the top-k weights (as Qwen3-MoE does)
        "norm_topk_prob": bool(meta.get("expert_weights_norm", qwen3)),
    })  # fmt: skip
    has_bias = "blk.0.attn_q.bias" in ckpt.tensors
    if qwen3:
        config["attention_bias"] = has_bias
    else:
        config["qkv_bias"] = has_bias
        shared = f"blk.{min(moe_layers, default=0)}.ffn_up_shexp.weight"
        config["shared_expert_intermediate_size"] = meta.int(
            "expert_shared_feed_forward_length",
            meta.tensor_rows(shared) if shared in ckpt.tensors else 0,
        )
    return config


def _mixtral(meta: Metadata) -> dict[str, Any]:
    experts = meta.get("expert_count", 0)
    if not experts:
        raise NotAnMoEModel(meta.checkpoint.path, "llama",
                            "llama.expert_count is 0 or absent (a dense Llama)")  # fmt: skip
    config = _common(meta, "mixtral")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    config.update({
        "head_dim": meta.int("attention.key_length", hidden // heads),
        "intermediate_size": meta.int("expert_feed_forward_length",
                                      meta.get("feed_forward_length")),
        "num_local_experts": meta.int("expert_count"),
    })  # fmt: skip
    return config


CONFIG_BUILDERS: dict[str, Callable[[Metadata], dict[str, Any]]] = {
    "deepseek2": _deepseek2,
    "qwen3moe": lambda meta: _qwen_moe(meta, qwen3=True),
    "qwen2moe": lambda meta: _qwen_moe(meta, qwen3=False),
    "llama": _mixtral,
}


def hf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """config.json's fields for this checkpoint; an architecture ktserve does not serve is
    refused by name."""
    build = CONFIG_BUILDERS.get(checkpoint.architecture)
    if build is None:
        raise UnsupportedGGUFArchitecture(checkpoint.path, checkpoint.architecture,
                                          tuple(CONFIG_BUILDERS))  # fmt: skip
    meta = Metadata(checkpoint)
    config = build(meta)
    check_core_shapes(meta, config)
    return config


def check_core_shapes(meta: Metadata, config: dict[str, Any]) -> None:
    """The tensors whose shapes the metadata fixes (embeddings, norms, routers, routed experts)
    checked before anything loads; the loaders check every other one as they read it."""
    ckpt = meta.checkpoint
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    experts = meta.int("expert_count")
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    expected = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
                "output_norm.weight": (hidden,)}  # fmt: skip
    for layer in range(config["num_hidden_layers"]):
        p = f"blk.{layer}."
        expected[p + "attn_norm.weight"] = (hidden,)
        expected[p + "ffn_gate_inp.weight"] = (experts, hidden)
        expected[p + "ffn_gate_exps.weight"] = (experts, inter, hidden)
        expected[p + "ffn_up_exps.weight"] = (experts, inter, hidden)
        expected[p + "ffn_down_exps.weight"] = (experts, hidden, inter)
    for name, shape in expected.items():
        if name in ckpt.tensors and ckpt.shape(name) != shape:
            raise GGUFTensorShapeMismatch(ckpt.path, name, shape, ckpt.shape(name))
