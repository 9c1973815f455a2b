"""config.json of a checkpoint, read once: `HFConfig` wraps the dict with typed getters that
raise `InvalidConfig` naming the key; ModelSpec and each family build their frozen configs on it.
A GGUF checkpoint's config.json is the one its metadata describes (ktserve/gguf/config.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktserve.checkpoint.errors import CheckpointDirNotFound, ConfigNotFound, InvalidConfig

_MISSING: Any = object()


@dataclass(frozen=True)
class HFConfig:
    """config.json of one checkpoint; `source` names it in error messages."""

    data: dict[str, Any]
    source: str

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> HFConfig:
        """Of a Hugging Face directory (its config.json) or a GGUF checkpoint (its metadata)."""
        from ktserve.gguf.files import is_gguf_path

        if is_gguf_path(path):
            from ktserve.gguf.config import hf_config
            from ktserve.gguf.container import open_checkpoint

            checkpoint = open_checkpoint(path)
            return cls(hf_config(checkpoint), str(checkpoint.path))
        return cls(*read_config_json(path))

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
