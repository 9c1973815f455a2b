"""The KV cache's sizes, read both by the manager that hands out its blocks (manager.py) and by
the tensors that hold them (tensors.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheConfig:
    num_layers: int
    entry_shapes: tuple[tuple[int, ...], ...]  # per component, e.g. ((kvh, d), (kvh, d))
    max_num_tokens: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_host_tokens: int = 0  # the host tier's size; 0: none

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or not self.entry_shapes:
            raise ValueError("a KV cache needs at least one layer and one component")
        if self.max_num_tokens <= 0 or self.block_size <= 0:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} and block_size={self.block_size} "
                "must be positive"
            )
        if self.max_num_host_tokens < 0:
            raise ValueError(f"max_num_host_tokens must be >= 0, got {self.max_num_host_tokens}")

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.max_num_tokens / self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier (none without prefix caching)."""
        return self.max_num_host_tokens // self.block_size if self.enable_prefix_caching else 0

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes over all layers: what the engine sizes the cache by."""
        elems = sum(math.prod(shape) for shape in self.entry_shapes)
        return self.num_layers * elems * torch.empty((), dtype=dtype).element_size()
