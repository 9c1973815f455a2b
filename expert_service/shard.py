"""The routed experts one worker holds: every MoE layer's packed weights for an expert id range.

Built from a Hugging Face checkpoint (read, quantize, pack: slow) or from a `ktserve convert`
directory (memory-mapped: seconds). Global expert ids map onto local ones here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from expert_service import packed_store
from expert_service.kernels import PackedExperts, pack_experts
from ktserve.checkpoint import (
    CheckpointReader,
    ModelSpec,
    check_memory_available,
    estimate_shard_bytes,
    validate_shard,
)

# Packed bytes per weight, scales included (int8: a scale per row; int4: per group of 32).
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0 + 4 / 2048, "int4": 0.5 + 2 / 32}

LoadProgress = Callable[[int, int, int], None]  # (layers done, layers total, bytes done)


@dataclass(frozen=True)
class ExpertShard:
    """Packed experts [start, stop) of every MoE layer of one model."""

    spec: ModelSpec
    source_dir: str
    weight_format: str
    experts: range
    layers: dict[int, PackedExperts]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layers.values())

    @property
    def expert_nbytes(self) -> int:
        return next(iter(self.layers.values())).expert_nbytes

    def localize(self, ids: np.ndarray) -> np.ndarray:
        """Global expert ids [T, k] -> ids local to this shard, -1 where not held (or -1)."""
        local = ids.astype(np.int32, copy=True)
        local -= self.experts.start
        local[(ids < self.experts.start) | (ids >= self.experts.stop)] = -1
        return local


def load_shard(
    model_dir: str | Path,
    experts: range | None,
    weight_format: str,
    *,
    pack_threads: int | None = None,
    progress: LoadProgress | None = None,
) -> ExpertShard:
    """Load a shard from a checkpoint or a `ktserve convert` directory (detected by its index)."""
    model_dir = Path(model_dir)
    if packed_store.is_packed_dir(model_dir):
        return packed_store.load(model_dir, experts, weight_format, progress=progress)
    with CheckpointReader(model_dir) as reader:
        spec = reader.spec
        experts = experts if experts is not None else range(spec.num_experts)
        validate_shard(spec, experts)
        required = estimate_shard_bytes(spec, len(experts), BYTES_PER_WEIGHT[weight_format])
        # NOTE: one layer is held in float32 while it is packed.
        transient = estimate_shard_bytes(spec, len(experts), 4.0) // max(spec.num_moe_layers, 1)
        check_memory_available(required + transient)
        layers: dict[int, PackedExperts] = {}
        done_bytes = 0
        for i, layer in enumerate(spec.moe_layers):
            gate, up, down = reader.read_experts(layer, list(experts))
            layers[layer] = pack_experts(gate, up, down, weight_format, num_threads=pack_threads)
            done_bytes += layers[layer].nbytes
            if progress is not None:
                progress(i + 1, len(spec.moe_layers), done_bytes)
    return ExpertShard(spec, str(model_dir), weight_format, experts, layers)


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
