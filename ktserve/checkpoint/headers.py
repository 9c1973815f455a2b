"""What a checkpoint holds, from its safetensors headers alone (no tensor data is read): each
tensor's dtype tag and shape, and from them the size of the part that is not routed experts (the
GPU part: attention, dense layers, shared experts, embeddings, head)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ktserve.checkpoint.errors import InvalidConfig, SafetensorsNotFound
from ktserve.checkpoint.fp8 import SCALE_SUFFIX
from ktserve.checkpoint.safetensors_index import INDEX_FILE, index_tensors

ROUTED_EXPERT_MARK = ".experts."  # ...mlp.experts.E... / ...block_sparse_moe.experts.E...
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_HEADER_LIMIT = 100 * 2**20  # safetensors caps its JSON header at 100 MB


def read_header(path: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} of one safetensors file ("__metadata__" left
    out)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= _HEADER_LIMIT:
            raise InvalidConfig(path, f"not a safetensors file (header length {size})")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise InvalidConfig(path, f"unreadable safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    return header


def tensor_headers(model_dir: str | Path) -> dict[str, dict]:
    """Every tensor's header entry, over the checkpoint's safetensors files: those its index
    names where it has one (as the loaders read it: safetensors_index.index_tensors), else all
    of them. A GGUF checkpoint's: each Hugging Face name's dtype as read (F32) and shape."""
    from ktserve.gguf.files import is_gguf_path

    if is_gguf_path(model_dir):
        from ktserve.gguf.tensors import GGUFTensors

        tensors = GGUFTensors(model_dir)
        return {name: {"dtype": "F32", "shape": list(tensors.shape(name))}
                for name in tensors.names()}  # fmt: skip
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        paths = sorted(set(index_tensors(model_dir).values()))
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise SafetensorsNotFound(model_dir)
    tensors: dict[str, dict] = {}
    for path in paths:
        tensors.update(read_header(path))
    return tensors


def is_routed_expert(name: str) -> bool:
    return ROUTED_EXPERT_MARK in name


def non_expert_params(model_dir: str | Path) -> int:
    """Elements of the tensors that are not routed experts, FP8 block scales left out: what the
    GPU part holds unquantized (times 2 bytes in bf16). Layers past num_hidden_layers (GLM-4.5's
    multi-token-prediction layers) are left out too: nothing loads them."""
    from ktserve.checkpoint.config_json import HFConfig

    headers = tensor_headers(model_dir)
    num_layers = HFConfig.from_checkpoint(model_dir).int("num_hidden_layers")
    return sum(
        math.prod(meta["shape"])
        for name, meta in headers.items()
        if not is_routed_expert(name)
        and not name.endswith(SCALE_SUFFIX)
        and layer_index(name) < num_layers
    )


def layer_index(name: str) -> int:
    """L of a `model.layers.L.` tensor; -1 for one outside the decoder layers."""
    found = _LAYER.match(name)
    return int(found.group(1)) if found else -1
