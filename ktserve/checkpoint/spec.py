"""ModelSpec: the routed-expert geometry of an MoE checkpoint, and the one table of families."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktserve.checkpoint.config_json import HFConfig
from ktserve.checkpoint.errors import (
    InvalidConfig,
    LayerHasNoExperts,
    NotAnMoEModel,
    ShardOutOfRange,
    UnsupportedArchitecture,
)


@dataclass(frozen=True)
class Family:
    """How one config.json model_type names and places its routed experts.

    moe_layers: "all" (every layer), "deepseek" (first_k_dense_replace, moe_layer_freq; GLM-4.5
    too) or "qwen" (decoder_sparse_step, mlp_only_layers); layers past num_hidden_layers (GLM's
    MTP layers) hold no served experts. expert_names: the (gate, up, down) suffixes under
    `{moe_module}.experts.E`.
    """

    model_type: str
    moe_layers: str
    intermediate_key: str = "moe_intermediate_size"
    moe_module: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("deepseek_v3", moe_layers="deepseek"),
        Family("deepseek_v2", moe_layers="deepseek"),
        Family("glm4_moe", moe_layers="deepseek"),
        Family("qwen3_moe", moe_layers="qwen"),
        Family("qwen2_moe", moe_layers="qwen"),
        Family("mixtral", moe_layers="all", intermediate_key="intermediate_size",
               moe_module="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    )
}  # fmt: skip
SUPPORTED_FAMILIES = tuple(FAMILIES)

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
        family = FAMILIES[self.family]
        prefix = f"model.layers.{layer}.{family.moe_module}.experts.{expert}"
        gate, up, down = (f"{prefix}.{name}.weight" for name in family.expert_names)
        return gate, up, down

    def fused_tensor_names(self, layer: int) -> tuple[str, str]:
        """(gate_up, down) tensor names of a layer's experts in transformers 5's fused naming."""
        prefix = f"model.layers.{layer}.mlp.experts"
        return f"{prefix}.gate_up_proj", f"{prefix}.down_proj"

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelSpec:
        return cls.from_hf(HFConfig.from_checkpoint(path))

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "<config>") -> ModelSpec:
        return cls.from_hf(HFConfig(config, source))

    @classmethod
    def from_hf(cls, hf: HFConfig) -> ModelSpec:
        model_type, source = hf.model_type, hf.source
        family = FAMILIES.get(model_type)
        if family is None:
            if not any(hf.data.get(k) for k in _EXPERT_COUNT_KEYS):
                keys = "/".join(_EXPERT_COUNT_KEYS)
                raise NotAnMoEModel(source, model_type, f"it sets none of {keys}")
            raise UnsupportedArchitecture(source, model_type, SUPPORTED_FAMILIES)
        num_layers = hf.int("num_hidden_layers")
        # NOTE: Hub configs and transformers 5 disagree on the key (Qwen3-MoE: num_experts on the
        # Hub, num_local_experts from transformers 5), so every family accepts any of them.
        count_key = next((k for k in _EXPERT_COUNT_KEYS if k in hf.data), _EXPERT_COUNT_KEYS[0])
        num_experts = hf.int(count_key, 0, minimum=0)
        if not num_experts:
            raise NotAnMoEModel(source, model_type, f"it has {num_experts} routed experts")
        moe_layers = _moe_layers(family, num_layers, hf)
        if not moe_layers:
            raise NotAnMoEModel(source, model_type, "none of its layers has routed experts")
        try:
            return cls(
                family=model_type,
                num_layers=num_layers,
                hidden_size=hf.int("hidden_size"),
                moe_intermediate_size=hf.int(family.intermediate_key),
                num_experts=num_experts,
                num_experts_per_tok=hf.int("num_experts_per_tok"),
                moe_layers=moe_layers,
                weight_block_size=_weight_block_size(hf.data.get("quantization_config"), source),
            )
        except InvalidConfig as exc:
            raise InvalidConfig(source, exc.reason) from None


def _moe_layers(family: Family, num_layers: int, hf: HFConfig) -> tuple[int, ...]:
    if family.moe_layers == "all":
        return tuple(range(num_layers))
    if family.moe_layers == "deepseek":
        first_dense = hf.int("first_k_dense_replace", 0, minimum=0)
        freq = hf.int("moe_layer_freq", 1)
        return tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
    step = hf.int("decoder_sparse_step", 1)
    mlp_only = set(hf.int_list("mlp_only_layers"))
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
