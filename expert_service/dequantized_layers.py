"""Packing a layer of experts from a checkpoint whose reads dequantize (GGUF, for now: kernels that
compute in the GGUF types are the next stage, docs/gguf.md): a few experts at a time are read as
float32 and packed into their rows of the layer's buffers, so a layer never sits in float32 whole
(DeepSeek-V3's would be 45 GB)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from expert_service.kernels import PackedExperts, pack_expert_list
from expert_service.kernels.arrays import aligned_empty
from ktserve.checkpoint import CheckpointReader
from ktserve.checkpoint.reader import StoredExperts
from ktserve.packed_layout import tensor_specs

CHUNK_BYTES = 256 * 2**20  # float32 weights dequantized at once while packing a layer

RowSlicer = Callable[[StoredExperts], StoredExperts | None]


def experts_per_chunk(hidden: int, inter: int) -> int:
    return max(1, CHUNK_BYTES // (3 * hidden * inter * 4))


def pack_dequantized_layer(reader: CheckpointReader, layer: int, experts: range,
                           weight_format: str, num_threads: int | None,
                           out: dict[str, np.ndarray] | None = None,
                           rows: range | None = None,
                           slice_rows: RowSlicer | None = None) -> PackedExperts:  # fmt: skip
    """The layer's `experts` packed in `weight_format`, chunk by chunk, into `out` (or new
    buffers). rows / slice_rows: only these intermediate rows, cut by slice_rows."""
    spec = reader.spec
    hidden = spec.hidden_size
    inter = len(rows) if rows is not None else spec.moe_intermediate_size
    ids = list(experts)
    if out is None:
        specs = tensor_specs(weight_format, hidden, inter)
        out = {name: aligned_empty((len(ids), width), dtype)
               for name, (dtype, width) in specs.items()}  # fmt: skip
    step = experts_per_chunk(hidden, spec.moe_intermediate_size)
    for start in range(0, len(ids), step):
        part = ids[start : start + step]
        stored = reader.stored_experts(layer, part)
        if stored is None:
            raise ValueError(f"layer {layer}: the checkpoint's experts cannot be read one by one")
        if slice_rows is not None:
            stored = slice_rows(stored)
        rows_out = {name: buffer[start : start + len(part)] for name, buffer in out.items()}
        pack_expert_list(stored.weights, weight_format, num_threads=num_threads, out=rows_out)
    return PackedExperts(weight_format, len(ids), hidden, inter, out)
