"""Building blocks shared by the families: Linear (linear.py: one module per GPU weight format),
RMSNorm and the dense SwiGLU MLP, with the exact dtype handling of transformers 5 (RMSNorm
normalizes in float32, scales in model dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.layers import fused_ops
from gpu_service.layers.linear import Linear
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.parallel import RowParallelLinear

__all__ = ["DenseMLP", "Linear", "RMSNorm"]


class RMSNorm(nn.Module):
    """fused_kernels: fused_ops' kernels where they apply (False: the torch code only)."""

    def __init__(self, weight: torch.Tensor, eps: float, *, fused_kernels: bool = True) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.eps = eps
        self.fused_kernels = fused_kernels

    @classmethod
    def load(cls, loader: WeightLoader, name: str, size: int, eps: float, *,
             fused_kernels: bool) -> RMSNorm:  # fmt: skip
        return cls(loader.get(f"{name}.weight", (size,)), eps, fused_kernels=fused_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_kernels and self.weight.dtype == x.dtype
        if fused and fused_ops.supports(x, self.weight):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_then_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(h + delta, this norm of it) for h, delta [T, D]: one kernel where fused_ops runs."""
        fused = self.fused_kernels and self.weight.dtype == h.dtype == delta.dtype
        if fused and h.dim() == 2 and fused_ops.supports(h, delta, self.weight):
            return fused_ops.add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); also the shared experts of DeepSeek and Qwen2-MoE."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    @classmethod
    def load(
        cls,
        loader: WeightLoader,
        prefix: str,
        hidden: int,
        inter: int,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        bias: bool = False,
        reduce: bool = True,
    ) -> DenseMLP:
        """With tensor parallelism (loader.tp) gate/up are column-parallel and down
        row-parallel: reduce=False leaves the rank's partial output unsummed (parallel.py)."""
        gate, up, down = names
        column = loader.tp.column()
        return cls(
            Linear.load(loader, f"{prefix}.{gate}", hidden, inter, bias=bias, shard=column),
            Linear.load(loader, f"{prefix}.{up}", hidden, inter, bias=bias, shard=column),
            RowParallelLinear.load(
                loader, f"{prefix}.{down}", inter, hidden, bias=bias, reduce=reduce
            ),  # fmt: skip
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
