"""The safetensors files of a Hugging Face checkpoint directory, by tensor name."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ktserve.checkpoint.errors import InvalidConfig, SafetensorsNotFound

INDEX_FILE = "model.safetensors.index.json"


def index_tensors(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index json when present, else by scanning."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidConfig(index_path, f"no readable weight_map ({exc!r})") from exc
        files = {name: model_dir / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                detail = f"{INDEX_FILE} names {file.name}, which is missing"
                raise SafetensorsNotFound(model_dir, detail)
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise SafetensorsNotFound(model_dir)
    files: dict[str, Path] = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), path))
    return files
