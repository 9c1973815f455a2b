"""The tensor-parallel group as the model sees it: a rank's place (TensorParallel) and the shard
of a weight it holds (Shard, take_shard). What is split how: parallel.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """Part `index` of `num_parts` equal parts of a tensor along `dim`."""

    dim: int
    num_parts: int
    index: int


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """This process's place in the tensor-parallel group: rank of world_size; group: the
    torch.distributed process group (None for a world of one)."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def column(self) -> Shard | None:
        """This rank's rows of a column-parallel weight (None: all of them)."""
        return Shard(0, self.world_size, self.rank) if self.sharded else None

    def row(self) -> Shard | None:
        """This rank's columns of a row-parallel weight (None: all of them)."""
        return Shard(1, self.world_size, self.rank) if self.sharded else None

    def kv_heads(self, num_kv_heads: int) -> tuple[int, Shard | None]:
        """(this rank's kv heads, their shard) for GQA: a share when num_kv_heads divides over
        the ranks, else the one head its query heads use (replicated on world / num_kv_heads
        ranks)."""
        if not self.sharded:
            return num_kv_heads, None
        if num_kv_heads % self.world_size == 0:
            return num_kv_heads // self.world_size, self.column()
        if self.world_size % num_kv_heads == 0:
            return 1, Shard(0, num_kv_heads, self.rank * num_kv_heads // self.world_size)
        raise ValueError(
            f"--tensor-parallel-size {self.world_size} and the model's {num_kv_heads} key/value "
            "heads: one must divide the other"
        )

    def local(self, size: int, what: str) -> int:
        """This rank's share of `size` (heads, features); ValueError if it does not divide."""
        if size % self.world_size:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} does not divide the model's {what} "
                f"({size}); choose a size that does"
            )
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.sharded:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.sharded:
            dist.broadcast(x, src=0, group=self.group)
        return x


SINGLE = TensorParallel()


def take_shard(tensor: torch.Tensor, shard: Shard | None, name: str) -> torch.Tensor:
    """The shard of `tensor` (contiguous); ValueError naming the tensor if it does not split."""
    if shard is None:
        return tensor
    size = tensor.shape[shard.dim]
    if size % shard.num_parts:
        raise ValueError(
            f"{name}: dimension {shard.dim} of shape {list(tensor.shape)} does not split into "
            f"{shard.num_parts} equal parts for tensor parallelism; choose a "
            "--tensor-parallel-size that divides it"
        )
    return tensor.chunk(shard.num_parts, dim=shard.dim)[shard.index].contiguous()
