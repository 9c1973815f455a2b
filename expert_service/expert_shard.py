"""The routed experts one worker holds: every MoE layer's packed weights for an expert id range.

Only the data; the loaders (`shard.load_shard` from a checkpoint, `packed_store.load` from a
`ktserve convert` directory) build it. Global expert ids map onto local ones here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from expert_service.kernels import PackedExperts
from ktserve.checkpoint import ModelSpec

LoadProgress = Callable[[int, int, int], None]  # (layers done, layers total, bytes done)


@dataclass(frozen=True)
class StoreLayout:
    """Where a shard's packed tensors lie in files (a packed store directory: packed_store), for
    a GPU service on the same host to map: {layer: {"file", "tensors": {name: {dtype, shape,
    offset}}}}."""

    dir: str
    layers: dict[int, dict]


@dataclass(frozen=True)
class ExpertShard:
    """Packed experts [start, stop) of every MoE layer of one model; with `intermediate`, only
    those rows of each expert's intermediate dimension (ktserve/intermediate_split.py)."""

    spec: ModelSpec
    source_dir: str
    weight_format: str
    experts: range
    layers: dict[int, PackedExperts]
    store: StoreLayout | None = None  # None: the tensors are in this process's private memory
    intermediate: range | None = None  # None: every row

    @property
    def rows(self) -> range:
        """The intermediate rows held, of [0, moe_intermediate_size)."""
        return self.intermediate or range(self.spec.moe_intermediate_size)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layers.values())

    @property
    def expert_nbytes(self) -> int:
        return next(iter(self.layers.values())).expert_nbytes

    @property
    def holds_all(self) -> bool:
        """Every expert of the model: global ids are local ones."""
        return self.experts.start == 0 and self.experts.stop == self.spec.num_experts

    def localize(self, ids: np.ndarray) -> np.ndarray:
        """Global expert ids [T, k] -> ids local to this shard, -1 where not held (or -1)."""
        local = ids.astype(np.int32, copy=True)
        local -= self.experts.start
        local[(ids < self.experts.start) | (ids >= self.experts.stop)] = -1
        return local
