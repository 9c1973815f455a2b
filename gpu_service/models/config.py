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
