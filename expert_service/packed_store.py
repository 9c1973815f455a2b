"""`ktserve convert` output: packed expert shards on disk, memory-mapped back at load.

DIR/ktserve-packed.json   {"format_version", "config" (the checkpoint's config.json),
                           "weight_format", "experts": [start, stop], "source",
                           "layers": {L: {"file", "tensors": {name: {dtype, shape, offset}}}}}
DIR/layer_LLL.bin         the layer's packed tensors, each at a 64-byte-aligned offset
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from expert_service.expert_shard import ExpertShard, LoadProgress, StoreLayout
from expert_service.kernels import PackedExperts
from ktserve import shared_store
from ktserve.checkpoint import CheckpointError, HFConfig, ModelSpec, validate_shard
from ktserve.packed_layout import tensor_specs

INDEX_NAME = "ktserve-packed.json"
FORMAT_VERSION = 1
ALIGN = 64


class PackedStoreError(CheckpointError):
    """A `ktserve convert` directory that cannot serve the request."""


def is_packed_dir(path: Path) -> bool:
    return (path / INDEX_NAME).is_file()


def write_layer(out: Path, layer: int, packed: PackedExperts) -> dict:
    """Write one layer's packed tensors to out/layer_LLL.bin; returns its index entry."""
    name = f"layer_{layer:03d}.bin"
    entries, offset = {}, 0
    with open(out / (name + ".tmp"), "wb") as f:
        for tname, arr in sorted(packed.tensors.items()):
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            entries[tname] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset}
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
            offset += arr.nbytes
    os.replace(out / (name + ".tmp"), out / name)
    return {"file": name, "tensors": entries}


def create_layer(out: Path, layer: int, weight_format: str, num_experts: int,
                 spec: ModelSpec) -> tuple[dict, dict[str, np.ndarray]]:  # fmt: skip
    """A layer file laid out as write_layer lays it out, zero-filled; returns its index entry
    and writable mapped arrays of its tensors to pack into (in place: no copy to write)."""
    name = f"layer_{layer:03d}.bin"
    specs = tensor_specs(weight_format, spec.hidden_size, spec.moe_intermediate_size)
    entries, offset = {}, 0
    for tname, (dtype, per_expert) in sorted(specs.items()):
        offset += -offset % ALIGN
        shape = [num_experts, per_expert]
        entries[tname] = {"dtype": dtype.str, "shape": shape, "offset": offset}
        offset += num_experts * per_expert * dtype.itemsize
    with open(out / name, "wb") as f:
        f.truncate(offset)
    tensors = {
        tname: np.memmap(
            out / name,
            dtype=np.dtype(t["dtype"]),
            mode="r+",
            offset=t["offset"],
            shape=tuple(t["shape"]),
        )  # fmt: skip
        for tname, t in entries.items()
    }
    return {"file": name, "tensors": entries}, tensors


def write_index(out: Path, spec_config: dict, weight_format: str, experts: range, source: str,
                layers: dict[int, dict]) -> None:  # fmt: skip
    """The index, written last (atomically), so a directory without one holds no store."""
    index = {
        "format_version": FORMAT_VERSION,
        "config": spec_config,
        "weight_format": weight_format,
        "experts": [experts.start, experts.stop],
        "source": source,
        "layers": {str(layer): entry for layer, entry in sorted(layers.items())},
    }
    tmp = out / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX_NAME)


def map_layer(path: Path, entry: dict, weight_format: str, num_experts: int,
              spec: ModelSpec) -> PackedExperts:  # fmt: skip
    """One layer's tensors memory-mapped read-only from the file its index entry names."""
    file = path / entry["file"]
    tensors = {
        name: np.memmap(
            file, dtype=np.dtype(t["dtype"]), mode="r", offset=t["offset"], shape=tuple(t["shape"])
        )  # fmt: skip
        for name, t in entry["tensors"].items()
    }
    return PackedExperts.from_tensors(
        weight_format, num_experts, spec.hidden_size, spec.moe_intermediate_size, tensors
    )


def pack_layers(
    spec: ModelSpec,
    model_dir: Path,
    experts: range,
    weight_format: str,
    store_dir: Path | None,
    pack_layer: Callable[[int, dict[str, np.ndarray] | None], PackedExperts],
    progress: LoadProgress | None = None,
) -> tuple[dict[int, PackedExperts], StoreLayout | None]:
    """Every MoE layer of the shard, each made by pack_layer(layer, out): with a store, out is
    the layer file's writable mapped arrays to pack into, and the layer is then served from a
    read-only mapping of that file; without one (store_dir None), out is None and the layer
    stays in private memory. The store's index goes last; a failure part-way removes the store."""
    layers: dict[int, PackedExperts] = {}
    entries: dict[int, dict] = {}
    done_bytes = 0
    try:
        for i, layer in enumerate(spec.moe_layers):
            out = None
            if store_dir is not None:  # NOTE: packed straight into the store's file
                entries[layer], out = create_layer(store_dir, layer, weight_format, len(experts),
                                                   spec)  # fmt: skip
            packed = pack_layer(layer, out)
            if store_dir is not None:  # NOTE: served from a read-only mapping of it
                del out
                packed = map_layer(store_dir, entries[layer], weight_format, len(experts), spec)
            layers[layer] = packed
            done_bytes += packed.nbytes
            if progress is not None:
                progress(i + 1, len(spec.moe_layers), done_bytes)
        store = None
        if store_dir is not None:
            write_index(store_dir, HFConfig.from_checkpoint(model_dir).data, weight_format, experts,
                        str(model_dir), entries)  # fmt: skip
            store = StoreLayout(str(store_dir), entries)
    except BaseException:
        if store_dir is not None:
            shared_store.remove(store_dir)
        raise
    return layers, store


def save(shard: ExpertShard, out_dir: str | Path, config: dict) -> Path:
    """Write every layer of `shard`; the index is written last, so a crash leaves no index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = {layer: write_layer(out, layer, packed) for layer, packed in shard.layers.items()}
    write_index(out, config, shard.weight_format, shard.experts, shard.source_dir, layers)
    return out


def load(
    path: Path, experts: range | None, weight_format: str, *, progress: LoadProgress | None = None
) -> ExpertShard:
    """Map a converted shard back; the requested range and format must be what was converted."""
    index = json.loads((path / INDEX_NAME).read_text())
    if index.get("format_version") != FORMAT_VERSION:
        raise PackedStoreError(
            f"{path / INDEX_NAME}: format_version {index.get('format_version')}, this ktserve "
            f"reads {FORMAT_VERSION}; convert the checkpoint again"
        )
    spec = ModelSpec.from_config(index["config"], source=str(path / INDEX_NAME))
    held = range(*index["experts"])
    experts = held if experts is None else experts
    validate_shard(spec, experts)
    if experts != held or weight_format != index["weight_format"]:
        raise PackedStoreError(
            f"{path} holds experts {held.start}-{held.stop - 1} in {index['weight_format']}, "
            f"asked for {experts.start}-{experts.stop - 1} in {weight_format}; "
            "convert again or ask for what it holds"
        )
    layers = {}
    total, done_bytes = len(index["layers"]), 0
    for i, (layer, entry) in enumerate(sorted(index["layers"].items(), key=lambda kv: int(kv[0]))):
        layers[int(layer)] = map_layer(path, entry, weight_format, len(held), spec)
        done_bytes += layers[int(layer)].nbytes
        if progress is not None:
            progress(i + 1, total, done_bytes)
    if set(layers) != set(spec.moe_layers):
        raise PackedStoreError(f"{path}: layers {sorted(layers)} != MoE layers {spec.moe_layers}")
    store = StoreLayout(str(path.resolve()), {int(k): v for k, v in index["layers"].items()})
    return ExpertShard(spec, str(path), weight_format, held, layers, store)
