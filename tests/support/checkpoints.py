"""Tiny random Hugging Face MoE checkpoints made with transformers, and oracles read back from them.

Everything here comes from transformers itself (config classes, random init, save_pretrained,
from_pretrained) or from plain torch written independently of expert_service, so tests can compare
expert_service against it.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

FP8_BLOCK = (128, 128)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)

# Small but not round: odd-ish sizes, a dense first layer where the family has one, and a
# non-trivial MoE layer pattern for Qwen (mlp_only_layers / decoder_sparse_step).
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            vocab_size=101,
            hidden_size=72,
            intermediate_size=88,
            moe_intermediate_size=40,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=12,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=128,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            vocab_size=101,
            hidden_size=56,
            intermediate_size=72,
            moe_intermediate_size=28,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=10,
            n_shared_experts=1,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=128,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=101,
            hidden_size=56,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            mlp_only_layers=[2],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=10,
            num_experts_per_tok=3,
            max_position_embeddings=128,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=80,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=36,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=9,
            num_experts_per_tok=2,
            max_position_embeddings=128,
        ),
    ),
    # GLM-4.5's shape: a dense first layer, half the head rotated, attention biases, q/k norms,
    # grouped sigmoid routing with a scaling factor, one shared expert.
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            vocab_size=101,
            hidden_size=64,
            intermediate_size=88,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=12,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=3,
            topk_group=2,
            routed_scaling_factor=2.5,
            max_position_embeddings=128,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=36,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=128,
        ),
    ),
}

# FP8 sizes exercise partial 128x128 blocks in both dimensions (200 = 128 + 72, 192 = 128 + 64).
FP8_OVERRIDES: dict[str, Any] = {"hidden_size": 200, "moe_intermediate_size": 192}

# Routed-expert weights in either layout, written without expert_service's naming code.
_ROUTED_EXPERT = re.compile(
    r"^model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\."
    r"(\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight|gate_up_proj|down_proj)$"
)


def available_families() -> tuple[str, ...]:
    """Families of _TINY whose config class this transformers has."""
    return tuple(f for f, (cls, _) in _TINY.items() if hasattr(transformers, cls))


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    cls_name, kwargs = _TINY[family]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def make_tiny_checkpoint(
    family: str,
    path: str | Path,
    *,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    per_expert_names: bool = True,
    fp8: bool = False,
    fp8_block: tuple[int, int] = FP8_BLOCK,
    max_shard_size: int | str | None = None,
    **overrides: Any,
) -> Path:
    """Save a randomly initialised (seeded) tiny `family` model to `path` and return it.

    per_expert_names=True writes the Hub layout (...experts.E.gate_proj.weight); False writes
    transformers 5's fused layout (...experts.gate_up_proj [E, 2I, H]). fp8=True then rewrites every
    routed-expert weight as float8_e4m3fn with 128x128 block scales (`<name>_scale_inv`) and adds
    DeepSeek-V3's quantization_config to config.json; FP8_OVERRIDES sizes are the default then.
    max_shard_size splits the weights over several files plus model.safetensors.index.json.
    """
    path = Path(path)
    if fp8:
        overrides = {**FP8_OVERRIDES, **overrides}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model = model.to(dtype)
    shard_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(
        path, safe_serialization=True, save_original_format=per_expert_names, **shard_kwargs
    )
    if family == "glm4_moe":
        _add_mtp_layer(path)
    if fp8:
        _quantize_checkpoint_fp8(path, fp8_block)
    return path


def _add_mtp_layer(path: Path) -> None:
    """Append what GLM-4.5 checkpoints hold after their decoder layers: one multi-token-prediction
    layer (num_nextn_predict_layers), model.layers.N: a decoder layer (here the last one's weights)
    plus eh_proj [H, 2H], enorm, hnorm and shared_head.norm, in a file of its own. Nothing that
    serves the model may read it; transformers ignores it too."""
    config = json.loads((path / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            prefix = f"model.layers.{last}."
            if name.startswith(prefix):
                tensors[f"model.layers.{last + 1}.{name.removeprefix(prefix)}"] = tensor
    dtype = tensors[f"model.layers.{last + 1}.input_layernorm.weight"].dtype
    mtp = f"model.layers.{last + 1}"
    tensors[f"{mtp}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden).to(dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}.{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    save_file(tensors, path / "model-mtp.safetensors", metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
        index.write_text(json.dumps(data, indent=2))


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [..., out, in], scale_inv [..., ceil(out/bo), ceil(in/bi)]), scale = amax / 448."""
    *lead, rows, cols = weight.shape
    w = weight.float()
    scale = torch.empty((*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1])))
    quant = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for bi in range(scale.shape[-2]):
        for bj in range(scale.shape[-1]):
            r = slice(bi * block[0], (bi + 1) * block[0])
            c = slice(bj * block[1], (bj + 1) * block[1])
            amax = w[..., r, c].abs().amax(dim=(-2, -1)).clamp(min=1e-12)  # [...]
            scale[..., bi, bj] = amax / FP8_MAX
            quant[..., r, c] = (w[..., r, c] / scale[..., bi, bj, None, None]).to(
                torch.float8_e4m3fn
            )
    return quant, scale


def dequantize_fp8_reference(
    quant: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """float32 from FP8 + block scales, one block at a time (an oracle for the reader's dequant)."""
    out = torch.empty(quant.shape, dtype=torch.float32)
    for bi in range(scale_inv.shape[-2]):
        for bj in range(scale_inv.shape[-1]):
            r = slice(bi * block[0], (bi + 1) * block[0])
            c = slice(bj * block[1], (bj + 1) * block[1])
            out[..., r, c] = quant[..., r, c].float() * scale_inv[..., bi, bj, None, None].float()
    return out


def _quantize_checkpoint_fp8(path: Path, block: tuple[int, int]) -> None:
    new_names: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if _ROUTED_EXPERT.match(n)]:
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(tensors[name], block)
            new_names[f"{name}_scale_inv"] = file.name
        save_file(tensors, file, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(new_names)
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))


def load_reference_model(path: str | Path) -> transformers.PreTrainedModel:
    """The checkpoint loaded back by transformers in float32 (eval mode), for oracle use.

    FP8 checkpoints are dequantized block by block (dequantize_fp8_reference) into a temporary
    float32 copy first: transformers' own FP8 loader needs whole blocks and accelerate.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if "quantization_config" not in config:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.eval()
    block = tuple(config["quantization_config"].get("weight_block_size", FP8_BLOCK))
    with tempfile.TemporaryDirectory(prefix="ktserve-ref-") as tmp:
        del config["quantization_config"]
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        for file in sorted(path.glob("*.safetensors")):
            tensors = load_file(file)
            for name in [n for n in tensors if n.endswith("_scale_inv")]:
                weight_name = name.removesuffix("_scale_inv")
                scale = tensors.pop(name)
                tensors[weight_name] = dequantize_fp8_reference(tensors[weight_name], scale, block)
            save_file(tensors, Path(tmp) / file.name, metadata={"format": "pt"})
        index = path / "model.safetensors.index.json"
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"] = {
                k: v for k, v in data["weight_map"].items() if not k.endswith("_scale_inv")
            }
            (Path(tmp) / index.name).write_text(json.dumps(data))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return model.eval()


def moe_block(model: transformers.PreTrainedModel, layer: int) -> torch.nn.Module:
    """The sparse MoE block of decoder layer `layer` (raises if that layer is dense)."""
    decoder_layer = model.model.layers[layer]
    block = getattr(decoder_layer, "block_sparse_moe", None) or decoder_layer.mlp
    if not hasattr(block, "experts"):
        raise ValueError(f"layer {layer} of {type(model).__name__} has no routed experts")
    return block


def reference_expert_weights(
    model: transformers.PreTrainedModel, layer: int, expert: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) of one expert, read from the model's own modules.

    transformers 5 holds experts fused (gate_up_proj [E, 2I, H], gate rows first, and down_proj
    [E, H, I], used as F.linear(x, gate_up_proj[e]).chunk(2)); older versions hold one module per
    expert (gate_proj/up_proj/down_proj or Mixtral's w1/w3/w2).
    """
    experts = moe_block(model, layer).experts
    with torch.no_grad():
        if hasattr(experts, "gate_up_proj"):
            gate, up = experts.gate_up_proj[expert].chunk(2, dim=0)
            down = experts.down_proj[expert]
        elif hasattr(experts[expert], "w1"):
            module = experts[expert]
            gate, up, down = module.w1.weight, module.w3.weight, module.w2.weight
        else:
            module = experts[expert]
            gate, up, down = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    return gate.detach().clone(), up.detach().clone(), down.detach().clone()


def moe_layer_indices(model: transformers.PreTrainedModel) -> tuple[int, ...]:
    """Decoder layers whose MLP holds routed experts, found from the modules themselves."""
    found = []
    for i, decoder_layer in enumerate(model.model.layers):
        block = getattr(decoder_layer, "block_sparse_moe", None) or decoder_layer.mlp
        if hasattr(block, "experts"):
            found.append(i)
    return tuple(found)
