"""GGUF tensor names <-> the Hugging Face names the model families load, per architecture.

llama.cpp's converter renames every tensor (model.layers.L.self_attn.q_proj.weight ->
blk.L.attn_q.weight), stacks a layer's routed experts into one 3-D tensor per projection
(blk.L.ffn_gate_exps.weight [E, I, H] in torch order) and, for some tensors, changes the data:
  llama (Mixtral)  q_proj and k_proj rows permuted for its rope (`permute` below, undone here);
  deepseek2        kv_b_proj split per head into attn_k_b (transposed) and attn_v_b (newer files;
                   older ones keep attn_kv_b): joined back here.
A `Source` says where one Hugging Face tensor comes from and what undoes the converter's change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# per layer: Hugging Face suffix under model.layers.L. -> GGUF suffix under blk.L.
_COMMON = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_PROJECTIONS = ("gate", "up", "down")
_GQA = {
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}  # fmt: skip
_MLA = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in _PROJECTIONS},
}  # fmt: skip
_QWEN_MOE = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in _PROJECTIONS},
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}  # fmt: skip
_MIXTRAL = {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}

LAYER_NAMES = {
    "deepseek2": {**_COMMON, **_MLA},
    "qwen3moe": {**_COMMON, **_GQA, **_QWEN_MOE},
    "qwen2moe": {**_COMMON, **_GQA, **_QWEN_MOE},
    "llama": {**_COMMON, **_GQA, **_MIXTRAL},
}
# (module, (gate, up, down) names) of the routed experts, per architecture
EXPERT_NAMES = {
    "deepseek2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "llama": ("block_sparse_moe", ("w1", "w3", "w2")),
}
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Source:
    """Where one Hugging Face tensor lies in the GGUF file, and how to undo the converter.

    undo: "" (as stored), "expert" (slice `expert` of a stacked tensor), "permute_q" / "permute_k"
    (llama's rope permutation, over the query / key-value heads), "join_kv_b" (names holds
    attn_k_b and attn_v_b), "row" (a [1, H] weight the file may hold as [H]).
    """

    names: tuple[str, ...]
    undo: str = ""
    expert: int | None = None


def source_of(arch: str, hf_name: str) -> Source | None:
    """The GGUF source of `hf_name` as a file of `arch` lays it out (None: no such tensor name in
    that architecture; whether the file has it is the caller's question)."""
    if hf_name in _GLOBAL:
        return Source((_GLOBAL[hf_name],))
    match = _LAYER.match(hf_name)
    if match is None:
        return None
    layer, suffix = match[1], match[2]
    expert = _expert_source(arch, layer, suffix)
    if expert is not None:
        return expert
    gguf_suffix = LAYER_NAMES[arch].get(suffix)
    if gguf_suffix is None:
        return None
    name = f"blk.{layer}.{gguf_suffix}"
    if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        return Source((name,), "permute_q")
    if arch == "llama" and suffix in ("self_attn.k_proj.weight", "self_attn.k_proj.bias"):
        return Source((name,), "permute_k")
    if suffix == "mlp.shared_expert_gate.weight":
        return Source((name,), "row")
    return Source((name,))


def _expert_source(arch: str, layer: str, suffix: str) -> Source | None:
    module, projections = EXPERT_NAMES[arch]
    match = re.match(rf"^{module}\.experts\.(\d+)\.(\w+)\.weight$", suffix)
    if match is None or match[2] not in projections:
        return None
    stacked = EXPERT_TENSORS[projections.index(match[2])]
    return Source((f"blk.{layer}.{stacked}",), "expert", int(match[1]))


def joined_kv_b(layer: int) -> Source:
    return Source(tuple(f"blk.{layer}.{name}" for name in SPLIT_KV_B), "join_kv_b")


def hf_names_of(arch: str, gguf_name: str, num_experts: int) -> list[str]:
    """The Hugging Face names a GGUF tensor serves (several for stacked experts; none for a
    tensor the families do not load, e.g. rope_freqs)."""
    for hf, gguf in _GLOBAL.items():
        if gguf == gguf_name:
            return [hf]
    match = _BLOCK.match(gguf_name)
    if match is None:
        return []
    layer, suffix = match[1], match[2]
    prefix = f"model.layers.{layer}."
    if suffix in EXPERT_TENSORS:
        module, projections = EXPERT_NAMES[arch]
        projection = projections[EXPERT_TENSORS.index(suffix)]
        return [f"{prefix}{module}.experts.{e}.{projection}.weight" for e in range(num_experts)]
    if arch == "deepseek2" and suffix == SPLIT_KV_B[0]:
        return [f"{prefix}self_attn.kv_b_proj.weight"]
    return [prefix + hf for hf, gguf in LAYER_NAMES[arch].items() if gguf == suffix]
