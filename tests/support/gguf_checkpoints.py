"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from a tiny Hugging
Face checkpoint, with the gguf package's own GGUFWriter, tensor name map and quantizers; and the
reference weights a GGUF holds (its tensors dequantized by the gguf package, in the Hugging Face
layout), for transformers to run as the oracle.

The converter's changes, as llama.cpp makes them: llama (Mixtral) q/k rows permuted for its rope,
a layer's experts stacked into one [E, ...] tensor per projection, DeepSeek's kv_b_proj split
per head into attn_k_b (transposed) and attn_v_b, e_score_correction_bias -> exp_probs_b.bias,
1-D tensors (norms, biases) kept F32.

K-quants: the gguf package cannot quantize them, so their tensors are random valid blocks (finite
scales); the reference is what the package dequantizes from those bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

ARCH = {"deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "qwen3_moe": "qwen3moe",
        "qwen2_moe": "qwen2moe", "mixtral": "llama"}  # fmt: skip
_MODEL_ARCH = {"deepseek2": gguf.MODEL_ARCH.DEEPSEEK2, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
               "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "llama": gguf.MODEL_ARCH.LLAMA}  # fmt: skip
# where each K-quant keeps its f16 scales (byte offsets in its block): set finite, so random
# blocks dequantize to finite weights
_K_QUANT_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,)}
# Sizes that whole blocks divide (K-quants: 256 values a row) for the families' GGUF fixtures.
GGUF_OVERRIDES = {
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=288),
    # NOTE: as llama.cpp runs qwen3moe: no dense layer (its tensor map has no ffn_down), top-k
    # weights normalized
    "qwen3_moe": dict(
        hidden_size=256,
        moe_intermediate_size=256,
        intermediate_size=288,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    "mixtral": dict(hidden_size=256, intermediate_size=256),
}

TypeChooser = Callable[[str, tuple[int, ...]], T]  # (gguf name, torch shape) -> its type


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))  # fmt: skip


def float_types(name: str, shape: tuple[int, ...]) -> T:
    """Every tensor as the checkpoint holds it (bf16), 1-D ones F32, as llama.cpp writes them."""
    return T.F32 if len(shape) == 1 else T.BF16


def mixed_types(name: str, shape: tuple[int, ...]) -> T:
    """A mix: experts K-quants (Q4_K gate/up, Q6_K down) where rows are whole 256-blocks,
    attention Q8_0, the rest F16 / BF16, F32 where rows fit no block."""
    row = shape[-1]
    if len(shape) == 1:
        return T.F32
    if "_exps" in name and row % 256 == 0:
        return T.Q6_K if "down" in name else T.Q4_K
    if ".attn_" in name and row % 32 == 0:
        return T.Q8_0
    if "token_embd" in name or "output." in name:
        return T.F16
    return T.BF16 if row % 2 == 0 else T.F32


def stored_types(types: TypeChooser, rng: np.random.Generator):
    def store(name: str, data: np.ndarray) -> tuple[np.ndarray, T]:
        qtype = types(name, data.shape)
        if qtype in _K_QUANT_SCALES:
            return random_k_quant(data.shape, qtype, rng), qtype
        return quantize(data.astype(np.float32), qtype), qtype

    return store


def random_k_quant(shape: tuple[int, ...], qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` for a tensor of `shape`, their f16 scales small and finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    blocks = rng.integers(0, 256, (rows * shape[-1] // block, size), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[qtype]:
        scale = rng.uniform(2e-4, 2e-3, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


class _Converted:
    """The tensors as the converter yields them: (gguf name, float32 data), HF name kept."""

    def __init__(self, config: dict, arch: str, weights: dict[str, torch.Tensor]) -> None:
        self.config, self.arch = config, arch
        self.map = gguf.get_tensor_name_map(_MODEL_ARCH[arch], config["num_hidden_layers"])
        self.tensors: list[tuple[str, str, torch.Tensor]] = []  # (gguf, hf, data)
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for name, data in sorted(weights.items()):
            data = data.float()
            parts = name.split(".")
            if ".experts." in name and parts[5].isdigit():
                experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = data
                continue
            self._add(name, data)
        for (layer, projection), per_expert in sorted(experts.items()):
            stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])
            kind = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                    "down_proj": "down", "w2": "down"}[projection]  # fmt: skip
            hf_name = f"model.layers.{layer}.experts.{projection}"
            self.tensors.append((f"blk.{layer}.ffn_{kind}_exps.weight", hf_name, stacked))

    def _add(self, name: str, data: torch.Tensor) -> None:
        cfg = self.config
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, cfg["num_attention_heads"], cfg["num_attention_heads"])
        if self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if name.endswith("kv_b_proj.weight"):
            heads, nope, v = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                              cfg["v_head_dim"])  # fmt: skip
            kv_b = data.view(heads, nope + v, data.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            self._add(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous())
            self._add(name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous())
            return
        gguf_name = self.map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {name}"
        self.tensors.append((gguf_name, name, data))


def write_metadata(writer: gguf.GGUFWriter, config: dict, arch: str) -> None:
    """The keys convert_hf_to_gguf.py writes for these families."""
    w = writer
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    if arch == "deepseek2":
        w.add_head_count_kv(1)  # NOTE: MLA written as MQA with one compressed head
    else:
        w.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "deepseek2":
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        w.add_vocab_size(config["vocab_size"])
        if config.get("q_lora_rank"):
            w.add_q_lora_rank(config["q_lora_rank"])
        w.add_kv_lora_rank(config["kv_lora_rank"])
        w.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
        w.add_value_length(config["kv_lora_rank"])
        w.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        w.add_value_length_mla(config["v_head_dim"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_count(config["n_routed_experts"])
        w.add_expert_shared_count(config.get("n_shared_experts", 0))
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        if config.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(config["qk_rope_head_dim"])
        if config.get("n_group") is not None:
            w.add_expert_group_count(config["n_group"])
            w.add_expert_group_used_count(config["topk_group"])
        if config["model_type"] == "deepseek_v3":
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch == "qwen3moe":
            w.add_key_length(config["head_dim"])
            w.add_value_length(config["head_dim"])
        else:
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    else:
        w.add_expert_count(config["num_local_experts"])
        w.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
        w.add_vocab_size(config["vocab_size"])


def write_gguf(
    checkpoint: Path,
    out: Path,
    types: TypeChooser = float_types,
    *,
    seed: int = 0,
    tokenizer=None,
    tokenizer_pre: str = "default",
    split_max_tensors: int = 0,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write `checkpoint` (a tiny HF directory) as GGUF to `out` (with split_max_tensors, as a
    split set named out-0000i-of-0000n.gguf); returns (the first file, the reference weights:
    {HF name: float32 tensor the GGUF holds, dequantized}). tokenizer: an HF fast tokenizer
    written as llama.cpp writes a byte-level BPE vocabulary (tokenizer.ggml.*), tokenizer_pre its
    tokenizer.ggml.pre."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCH[config["model_type"]]
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(file))
    converted = _Converted(config, arch, weights)
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    writer.add_name(checkpoint.name)
    write_metadata(writer, config, arch)
    if tokenizer is not None:
        write_tokenizer(writer, tokenizer, tokenizer_pre)
    store = stored_types(types, np.random.default_rng(seed))
    held: dict[str, np.ndarray] = {}
    for gguf_name, _, data in converted.tensors:
        stored, qtype = store(gguf_name, data.numpy())
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        held[gguf_name] = dequantize(stored, qtype).reshape(data.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    first = out if not split_max_tensors else sorted(out.parent.glob(f"{out.stem}-*.gguf"))[0]
    return first, reference_weights(converted, held)


def reference_weights(converted: _Converted,
                      held: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The HF weights a GGUF holds: each converted tensor's dequantized data with the converter's
    change undone the way it was made (rows back in place, experts unstacked, kv_b joined)."""
    cfg, ref = converted.config, {}
    for gguf_name, hf_name, data in converted.tensors:
        value = torch.from_numpy(held[gguf_name].astype(np.float32))
        if ".experts." in hf_name or "_exps" in gguf_name:
            continue
        if "k_b_proj" in hf_name or "v_b_proj" in hf_name:
            continue
        if converted.arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            value = _inverse_rows(value, data, permute(
                torch.arange(data.shape[0], dtype=torch.float64)[:, None],
                cfg["num_attention_heads"],
                cfg["num_key_value_heads"] if "k_proj" in hf_name else cfg["num_attention_heads"],
            ))  # fmt: skip
        ref[hf_name.replace("e_score_correction.bias", "e_score_correction_bias")] = value
    for gguf_name, hf_name, _ in converted.tensors:
        if "_exps" in gguf_name:
            layer, kind = int(gguf_name.split(".")[1]), gguf_name.split(".")[2][4:-5]
            module, names = (("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})
                             if converted.arch == "llama" else
                             ("mlp", {k: f"{k}_proj" for k in ("gate", "up", "down")}))  # fmt: skip
            for e, w in enumerate(torch.from_numpy(held[gguf_name].astype(np.float32))):
                ref[f"model.layers.{layer}.{module}.experts.{e}.{names[kind]}.weight"] = w
        if "k_b_proj" in hf_name:
            k_b = torch.from_numpy(held[gguf_name].astype(np.float32))
            v_name = gguf_name.replace("attn_k_b", "attn_v_b")
            v_b = torch.from_numpy(held[v_name].astype(np.float32))
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
            ref[hf_name.replace("k_b_proj", "kv_b_proj")] = kv_b.reshape(-1, kv_b.shape[-1])
    return ref


def _inverse_rows(value: torch.Tensor, data: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows of `value` put back where the permutation that gave `order` took them from."""
    out = torch.empty_like(value)
    out[order[:, 0].long()] = value
    return out


def save_reference(checkpoint: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """A copy of the HF checkpoint directory holding `weights` (float32): transformers loads it
    as the oracle."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config))
    original = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        original.update(load_file(file))
    missing = set(original) - set(weights)
    assert not missing, f"the GGUF lost {sorted(missing)}"
    save_file({k: v.contiguous() for k, v in weights.items() if k in original},
              out / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return out


def write_tokenizer(writer: gguf.GGUFWriter, tokenizer, pre: str = "default") -> None:
    """A byte-level BPE vocabulary as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it: tokens
    by id, added special tokens CONTROL and other added ones USER_DEFINED, merges, the EOS id,
    the chat template."""
    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, token_types = [], []
    for i in range(len(by_id)):
        token = by_id[i]
        if i in added:
            token_types.append(gguf.TokenType.CONTROL if added[i].special
                               else gguf.TokenType.USER_DEFINED)  # fmt: skip
        else:
            token_types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
