"""The config fields every family shares; each family module builds its own frozen `*Config`
dataclass from ktserve.checkpoint.HFConfig (config.json, read once)."""

from __future__ import annotations

from dataclasses import dataclass

from ktserve.checkpoint import HFConfig, InvalidConfig


@dataclass(frozen=True)
class BaseConfig:
    """Fields of the decoder skeleton shared by every family (embed, layers, final norm, head)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise InvalidConfig(self.model_type, f"{name} must be positive")

    @classmethod
    def from_hf(cls, hf: HFConfig) -> BaseConfig:
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.int("vocab_size"),
            hidden_size=hf.int("hidden_size"),
            num_layers=hf.int("num_hidden_layers"),
            num_heads=hf.int("num_attention_heads"),
            rms_norm_eps=hf.float("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.bool("tie_word_embeddings", False),
            max_position_embeddings=hf.int("max_position_embeddings", 4096),
        )


def model_max_len(hf: HFConfig) -> int:
    """The model's own context length: max_position_embeddings, or with YaRN (rope_scaling or
    rope_parameters of type yarn) original_max_position_embeddings x factor where that is more
    (DeepSeek-V3: 4096 x 40 = 163,840; Qwen3 with YaRN 4: 32,768 x 4 = 131,072)."""
    max_pos = hf.int("max_position_embeddings", 4096)
    params = hf.dict("rope_scaling") or hf.dict("rope_parameters")
    if (params.get("rope_type") or params.get("type")) != "yarn":
        return max_pos
    original = params.get("original_max_position_embeddings") or hf.data.get(
        "original_max_position_embeddings"
    )
    factor = params.get("factor")
    if not original or not factor:
        return max_pos
    return max(max_pos, int(int(original) * float(factor)))
