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
A world of size 1 (`SINGLE`, sharding.py) makes every helper the plain, unsharded layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gpu_service.layers.linear import Linear
from gpu_service.layers.sharding import TensorParallel

if TYPE_CHECKING:
    from gpu_service.layers.loader import WeightLoader


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
