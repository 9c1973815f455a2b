"""Reading Hugging Face config.json with clear errors, and the fields every family shares.

`HFConfig` wraps the raw dict with typed getters that raise `InvalidConfig` naming the key;
each family module turns it into its own frozen `*Config` dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expert_service.checkpoint import InvalidConfig
from expert_service.checkpoint_spec import read_config_json

_MISSING: Any = object()


@dataclass(frozen=True)
class HFConfig:
    """config.json of one checkpoint; `source` names it in error messages."""

    data: dict[str, Any]
    source: str

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HFConfig:
        return cls(*read_config_json(model_dir))

    @property
    def model_type(self) -> str:
        return str(self.data.get("model_type", "<missing>"))

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _value(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise InvalidConfig(self.source, f"{key} is missing")
            return default
        return value

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidConfig(self.source, f"{key}={value!r} is not an integer >= {minimum}")
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        return self.int(key, minimum=minimum) if self.has(key) else None

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidConfig(self.source, f"{key}={value!r} is not a number")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise InvalidConfig(self.source, f"{key}={value!r} is not true/false")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            raise InvalidConfig(self.source, f"{key}={value!r} is not a string")
        return value

    def dict(self, key: str) -> dict[str, Any]:
        value = self.data.get(key) or {}
        if not isinstance(value, dict):
            raise InvalidConfig(self.source, f"{key} is not an object")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise InvalidConfig(self.source, f"{key}={value!r} is not a list of integers")
        return tuple(value)


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
