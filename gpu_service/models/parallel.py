"""Tensor parallelism inside the model: each rank holds a share of the attention heads and of the
dense / shared MLPs' intermediate columns; the rest (embedding, norms, routers, lm_head, MLA's
latent projections and cache) is replicated.

    column-parallel  W [out, in] split by rows (q/k/v, MLA's q_b and kv_b per head, gate/up):
                     each rank computes its out / N features from the whole input
    row-parallel     W [out, in] split by columns (o_proj, down): each rank multiplies its
                     in / N features, the partial outputs are summed over the ranks (all-reduce);
                     the bias is added on rank 0 only, before the sum, so it counts once

With `reduce=False` a row-parallel layer leaves its partial output to the caller, who sums it
with something else in the same collective (the MoE layer: shared expert + routed output).
A world of size 1 (`SINGLE`) makes every helper here the plain, unsharded layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from gpu_service.models.linear import Linear

if TYPE_CHECKING:
    from gpu_service.models.loader import WeightLoader


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


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ b on rank 0): `local` holds this rank's columns."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, tp: TensorParallel,
                 reduce: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.local, self.tp, self.reduce = local, tp, reduce
        self.register_buffer("bias", bias if tp.is_leader else None)
        self.kernel_name = getattr(local, "kernel_name", "linear")

    @classmethod
    def load(cls, loader: WeightLoader, prefix: str, in_features: int, out_features: int, *,
             bias: bool = False, reduce: bool = True) -> nn.Module:  # fmt: skip
        """`prefix`.weight split by input columns over loader.tp (the plain Linear when the world
        is one rank and reduce is on)."""
        tp = loader.tp
        if not tp.sharded and reduce:
            return Linear.load(loader, prefix, in_features, out_features, bias=bias)
        local = Linear.load(loader, prefix, in_features, out_features, shard=tp.row())
        b = loader.get(f"{prefix}.bias", (out_features,)) if bias else None
        return cls(local, b, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.bias is not None:
            y = y + self.bias
        return self.tp.all_reduce(y) if self.reduce else y
