"""ModelSpec: what the expert worker needs to know about an MoE model, read from config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expert_service.checkpoint_errors import (
    CheckpointDirNotFound,
    ConfigNotFound,
    InvalidConfig,
    LayerHasNoExperts,
    NotAnMoEModel,
    ShardOutOfRange,
    UnsupportedArchitecture,
)

SUPPORTED_FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "mixtral")
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v2")
QWEN_FAMILIES = ("qwen3_moe", "qwen2_moe")

# Keys that hold the number of routed experts, across Hugging Face MoE configs.
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
DEFAULT_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class ModelSpec:
    """The routed-expert geometry of one MoE checkpoint.

    Per-expert tensors (what Hub checkpoints hold; `expert_tensor_names`):
      gate [I, H], up [I, H], down [H, I]   with H = hidden_size, I = moe_intermediate_size.
    Fused tensors (transformers 5, `save_pretrained(save_original_format=False)`):
      model.layers.L.mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), .down_proj [E, H, I].
    """

    family: str
    num_layers: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_layers: tuple[int, ...]
    # NOTE: set only for block-quantized FP8 checkpoints (config.json quantization_config).
    weight_block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedArchitecture("ModelSpec", self.family, SUPPORTED_FAMILIES)
        for field in ("num_layers", "hidden_size", "moe_intermediate_size", "num_experts"):
            if getattr(self, field) <= 0:
                raise InvalidConfig("ModelSpec", f"{field} must be positive")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise InvalidConfig(
                "ModelSpec",
                f"num_experts_per_tok={self.num_experts_per_tok} is not in [1, {self.num_experts}]",
            )
        if any(not 0 <= layer < self.num_layers for layer in self.moe_layers):
            raise InvalidConfig("ModelSpec", f"moe_layers outside [0, {self.num_layers})")
        if self.weight_block_size is not None and min(self.weight_block_size) <= 0:
            raise InvalidConfig("ModelSpec", "weight_block_size must be positive")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def expert_num_params(self) -> int:
        """Weights in one expert: gate, up and down."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def check_expert(self, layer: int, expert: int) -> None:
        if layer not in self.moe_layers:
            raise LayerHasNoExperts(layer, self.moe_layers)
        if not 0 <= expert < self.num_experts:
            raise ShardOutOfRange("expert", str(expert), self.num_experts)

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """(gate, up, down) tensor names of one expert in the family's per-expert naming."""
        if self.family == "mixtral":
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
            return f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight"
        prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        return (
            f"{prefix}.gate_proj.weight",
            f"{prefix}.up_proj.weight",
            f"{prefix}.down_proj.weight",
        )

    def fused_tensor_names(self, layer: int) -> tuple[str, str]:
        """(gate_up, down) tensor names of a layer's experts in transformers 5's fused naming."""
        prefix = f"model.layers.{layer}.mlp.experts"
        return f"{prefix}.gate_up_proj", f"{prefix}.down_proj"

    @classmethod
    def from_config_dir(cls, path: str | Path) -> ModelSpec:
        config, source = read_config_json(path)
        return cls.from_config(config, source=source)

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "<config>") -> ModelSpec:
        model_type = str(config.get("model_type", "<missing>"))
        if model_type not in SUPPORTED_FAMILIES:
            if not any(config.get(k) for k in _EXPERT_COUNT_KEYS):
                keys = "/".join(_EXPERT_COUNT_KEYS)
                raise NotAnMoEModel(source, model_type, f"it sets none of {keys}")
            raise UnsupportedArchitecture(source, model_type, SUPPORTED_FAMILIES)
        reader = _ConfigReader(config, source)
        num_layers = reader.get_int("num_hidden_layers")
        # NOTE: Hub configs and transformers 5 disagree on the key (Qwen3-MoE: num_experts on the
        # Hub, num_local_experts from transformers 5), so every family accepts any of them.
        count_key = next((k for k in _EXPERT_COUNT_KEYS if k in config), _EXPERT_COUNT_KEYS[0])
        num_experts = reader.get_int(count_key, allow_zero=True, allow_none=True)
        if not num_experts:
            raise NotAnMoEModel(source, model_type, f"it has {num_experts} routed experts")
        moe_layers = _moe_layers(model_type, num_layers, reader)
        if not moe_layers:
            raise NotAnMoEModel(source, model_type, "none of its layers has routed experts")
        inter_key = "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"
        try:
            return cls(
                family=model_type,
                num_layers=num_layers,
                hidden_size=reader.get_int("hidden_size"),
                moe_intermediate_size=reader.get_int(inter_key),
                num_experts=num_experts,
                num_experts_per_tok=reader.get_int("num_experts_per_tok"),
                moe_layers=moe_layers,
                weight_block_size=_weight_block_size(config.get("quantization_config"), source),
            )
        except InvalidConfig as exc:
            raise InvalidConfig(source, exc.reason) from None


def _moe_layers(model_type: str, num_layers: int, reader: _ConfigReader) -> tuple[int, ...]:
    if model_type == "mixtral":
        return tuple(range(num_layers))
    if model_type in DEEPSEEK_FAMILIES:
        first_dense = reader.get_int("first_k_dense_replace", default=0, allow_zero=True)
        freq = reader.get_int("moe_layer_freq", default=1)
        return tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
    step = reader.get_int("decoder_sparse_step", default=1)
    mlp_only = set(reader.config.get("mlp_only_layers") or ())
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def _weight_block_size(quant: Any, source: str) -> tuple[int, int] | None:
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise InvalidConfig(source, "quantization_config is not an object")
    method = quant.get("quant_method")
    if method not in (None, "fp8"):
        raise InvalidConfig(
            source, f"quantization_config.quant_method {method!r} is not supported (only 'fp8')"
        )
    block = quant.get("weight_block_size", DEFAULT_FP8_BLOCK)
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise InvalidConfig(source, f"weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


@dataclass(frozen=True)
class _ConfigReader:
    config: dict[str, Any]
    source: str

    def get_int(
        self,
        key: str,
        *,
        default: int | None = None,
        allow_zero: bool = False,
        allow_none: bool = False,
    ) -> int:
        value = self.config.get(key, default)
        if value is None and allow_none:
            return 0
        if value is None:
            raise InvalidConfig(self.source, f"{key} is missing")
        minimum = 0 if allow_zero else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a non-negative" if allow_zero else "a positive"
            raise InvalidConfig(self.source, f"{key}={value!r} is not {kind} integer")
        return value


def read_config_json(model_dir: str | Path) -> tuple[dict, str]:
    """(config.json of a checkpoint directory as a dict, its path), with clear errors."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointDirNotFound(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigNotFound(path)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidConfig(config_path, f"not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidConfig(config_path, "the top level is not a JSON object")
    return config, str(config_path)
