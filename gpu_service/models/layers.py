"""Building blocks shared by the families: Linear, RMSNorm and the dense SwiGLU MLP, with the
exact dtype handling of transformers 5 (RMSNorm normalizes in float32, scales in model dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.models import fused_ops
from gpu_service.models.loader import WeightLoader


class Linear(nn.Module):
    """y = x W^T (+ b), W [out, in]; weights are buffers (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    @classmethod
    def load(
        cls,
        loader: WeightLoader,
        prefix: str,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Linear:
        weight = loader.get(f"{prefix}.weight", (out_features, in_features), dtype)
        b = loader.get(f"{prefix}.bias", (out_features,), dtype) if bias else None
        return cls(weight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.eps = eps

    @classmethod
    def load(cls, loader: WeightLoader, name: str, size: int, eps: float) -> RMSNorm:
        return cls(loader.get(f"{name}.weight", (size,)), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype and fused_ops.supports(x, self.weight):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); also the shared experts of DeepSeek and Qwen2-MoE."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
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
    ) -> DenseMLP:
        gate, up, down = names
        return cls(
            Linear.load(loader, f"{prefix}.{gate}", hidden, inter, bias=bias),
            Linear.load(loader, f"{prefix}.{up}", hidden, inter, bias=bias),
            Linear.load(loader, f"{prefix}.{down}", inter, hidden, bias=bias),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
