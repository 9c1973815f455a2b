"""The error bounds of each weight format's kernel against the reference MoE, and the error
measure."""

from __future__ import annotations

import torch

BOUNDS = {"bf16": 0.01, "int8": 0.05, "int4": 0.25}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))
