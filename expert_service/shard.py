"""Loading a worker's shard: from a Hugging Face or GGUF checkpoint (read, quantize, pack: slow) or
from a `ktserve convert` directory (memory-mapped: seconds, see packed_store); and a progress bar
for it.
"""

from __future__ import annotations

import time
from pathlib import Path

from expert_service import packed_store, synthetic_experts
from expert_service.dequantized_layers import pack_dequantized_layer
from expert_service.expert_shard import ExpertShard, LoadProgress
from expert_service.kernels import PackedExperts, pack_expert_list, pack_experts
from ktserve import shared_store
from ktserve.checkpoint import (
    CheckpointReader,
    check_memory_available,
    estimate_shard_bytes,
    validate_shard,
)
from ktserve.checkpoint.reader import StoredExperts
from ktserve.intermediate_split import format_rows, slice_or_whole

# Packed bytes per weight, scales included (int8: a scale per row; int4: per group of 32).
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0 + 4 / 2048, "int4": 0.5 + 2 / 32}


def load_shard(
    model_dir: str | Path,
    experts: range | None,
    weight_format: str,
    *,
    pack_threads: int | None = None,
    progress: LoadProgress | None = None,
    share: bool = False,
    intermediate: range | None = None,
) -> ExpertShard:
    """Load a shard from a checkpoint or a `ktserve convert` directory (detected by its index).

    share: a checkpoint's packed layers go to a store in /dev/shm (shared_store), each mapped
    back as soon as it is written, so another process can map the same pages; the caller
    removes `shard.store.dir` when done. Without room there they stay in private memory.
    intermediate: the rows of each expert's intermediate dimension to hold (None: all;
    ktserve/intermediate_split.py); a slice is never shared (a GPU service maps whole experts).
    """
    model_dir = Path(model_dir)
    if packed_store.is_packed_dir(model_dir):
        if intermediate is not None:
            raise ValueError(
                f"{model_dir} is a `ktserve convert` directory of whole experts; "
                f"--intermediate-rows {format_rows(intermediate)} needs the checkpoint itself"
            )
        return packed_store.load(model_dir, experts, weight_format, progress=progress)
    if synthetic_experts.is_synthetic_dir(model_dir):  # benchmarks only: refused without its env
        return synthetic_experts.load(model_dir, experts, weight_format, threads=pack_threads,
                                      progress=progress, share=share,
                                      intermediate=intermediate)  # fmt: skip
    with CheckpointReader(model_dir) as reader:
        spec = reader.spec
        experts = experts if experts is not None else range(spec.num_experts)
        validate_shard(spec, experts)
        intermediate = slice_or_whole(intermediate, spec.moe_intermediate_size)
        share = share and intermediate is None  # NOTE: a GPU service maps whole experts
        fraction = len(intermediate) / spec.moe_intermediate_size if intermediate else 1.0
        required = estimate_shard_bytes(spec, len(experts),
                                        BYTES_PER_WEIGHT[weight_format] * fraction)  # fmt: skip
        # NOTE: one layer is held while it is packed: as stored, or in float32 (fused layouts).
        transient = estimate_shard_bytes(spec, len(experts), 4.0) // max(spec.num_moe_layers, 1)
        check_memory_available(required + transient)
        store_dir = shared_store.create(required) if share else None

        def pack_layer(layer: int, out: dict | None) -> PackedExperts:
            return _pack_layer(reader, layer, experts, weight_format, pack_threads, out,
                               intermediate)  # fmt: skip

        layers, store = packed_store.pack_layers(spec, model_dir, experts, weight_format,
                                                 store_dir, pack_layer, progress)  # fmt: skip
    return ExpertShard(spec, str(model_dir), weight_format, experts, layers, store, intermediate)


def _pack_layer(reader: CheckpointReader, layer: int, experts: range, weight_format: str,
                pack_threads: int | None, out: dict | None = None,
                rows: range | None = None) -> PackedExperts:  # fmt: skip
    """One layer's experts packed from their tensors as stored (every core reads and converts,
    FP8 dequantized while packing), or from a float32 copy where the layout needs one; into
    `out`'s buffers where given. rows: only these rows of the intermediate dimension. A
    checkpoint whose reads dequantize (GGUF) is packed a few experts at a time."""
    if reader.dequantizes:
        inter = reader.spec.moe_intermediate_size
        slicer = None if rows is None else (lambda stored: _stored_rows(stored, rows, inter))
        return pack_dequantized_layer(reader, layer, experts, weight_format, pack_threads, out,
                                      rows, slicer)  # fmt: skip
    stored = reader.stored_experts(layer, list(experts))
    if stored is not None and rows is not None:
        stored = _stored_rows(stored, rows, reader.spec.moe_intermediate_size)
    if stored is not None:
        return pack_expert_list(stored.weights, weight_format, scales=stored.scales,
                                block=stored.block, num_threads=pack_threads, out=out)  # fmt: skip
    gate, up, down = reader.read_experts(layer, list(experts))  # [E, I, H], [E, I, H], [E, H, I]
    if rows is not None:
        r = slice(rows.start, rows.stop)
        gate, up, down = gate[:, r].contiguous(), up[:, r].contiguous(), down[:, :, r].contiguous()
    return pack_experts(gate, up, down, weight_format, num_threads=pack_threads, out=out)


def _stored_rows(stored: StoredExperts, rows: range, inter: int) -> StoredExperts | None:
    """Each expert's gate and up rows and down columns `rows`, read where they lie (gate and up
    rows are views; down's columns a copy); FP8 block scales sliced alike. None where an FP8
    slice does not fall on scale blocks (then the float32 path slices)."""
    r = slice(rows.start, rows.stop)
    weights = [(g[r], u[r], d[:, r].contiguous()) for g, u, d in stored.weights]
    if stored.scales is None:
        return StoredExperts(weights, None, stored.block)
    block_rows, block_cols = stored.block
    if not (_on_blocks(rows, block_rows, inter) and _on_blocks(rows, block_cols, inter)):
        return None
    rs = slice(rows.start // block_rows, -(-rows.stop // block_rows))
    cs = slice(rows.start // block_cols, -(-rows.stop // block_cols))
    scales = [(gs[rs], us[rs], ds[:, cs].contiguous()) for gs, us, ds in stored.scales]
    return StoredExperts(weights, scales, stored.block)


def _on_blocks(rows: range, block: int, size: int) -> bool:
    return rows.start % block == 0 and (rows.stop % block == 0 or rows.stop == size)


class ProgressPrinter:
    """A one-line progress bar on a stream (stderr), redrawn at most every 0.2 s."""

    def __init__(self, stream, label: str) -> None:
        self.stream = stream
        self.label = label
        self.start = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        width = 30
        filled = width * done // max(total, 1)
        elapsed = now - self.start
        rate = nbytes / elapsed / 1e9 if elapsed > 0 else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} layers, "
            f"{nbytes / 2**30:.2f} GiB, {elapsed:.1f} s ({rate:.2f} GB/s)"
        )
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
