"""Rotary position embeddings: plain RoPE and YaRN, computed as transformers 5 does.

cos/sin come as [T, dim/2] in float32 (already multiplied by YaRN's attention factor). Two pairings
of the rotated dims:
  half-split   (Llama, Qwen, Mixtral): pairs (x[i], x[i + dim/2]);
  interleaved  (DeepSeek):             pairs (x[2i], x[2i+1]); the output is de-interleaved
               ([rotated evens, rotated odds]), as transformers' DeepSeek-V3 does it. q and k get
               the same permutation, so q.k is unchanged and the cache may hold either layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gpu_service.layers import fused_ops
from ktserve.checkpoint import HFConfig, InvalidConfig

SUPPORTED_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    dim: int
    theta: float
    interleaved: bool = False
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise InvalidConfig("rope", f"rotary dim {self.dim} must be positive and even")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise InvalidConfig(
                "rope",
                f"rope type {self.rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}",
            )

    @classmethod
    def from_hf(cls, hf: HFConfig, dim: int, *, interleaved: bool = False) -> RopeConfig:
        """From `rope_scaling` (Hub) or `rope_parameters` (transformers 5), plus `rope_theta`."""
        params = hf.dict("rope_scaling") or hf.dict("rope_parameters")
        theta = params.get("rope_theta") or hf.float("rope_theta", 10000.0)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type == "default":
            return cls(dim=dim, theta=float(theta), interleaved=interleaved)
        max_pos = hf.int("max_position_embeddings", 4096)
        original = hf.data.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", max_pos
        )
        factor = params.get("factor")
        if factor is None:
            factor = max_pos / original
        return cls(
            dim=dim,
            theta=float(theta),
            interleaved=interleaved,
            rope_type=rope_type,
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    @property
    def softmax_scale_multiplier(self) -> float:
        """DeepSeek's extra factor on 1/sqrt(d): yarn_get_mscale(factor, mscale_all_dim)**2."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        mscale = yarn_get_mscale(self.factor, self.mscale_all_dim)
        return mscale * mscale


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention factor applied to cos/sin)."""
    exponents = torch.arange(0, cfg.dim, 2, dtype=torch.int64).to(torch.float) / cfg.dim
    if cfg.rope_type == "default":
        return 1.0 / (cfg.theta**exponents), 1.0
    attention_factor = cfg.attention_factor
    if attention_factor is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention_factor = yarn_get_mscale(cfg.factor, cfg.mscale) / yarn_get_mscale(
                cfg.factor, cfg.mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(cfg.factor)

    def correction_dim(num_rotations: float) -> float:
        ratio = cfg.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (cfg.dim * math.log(ratio)) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, cfg.dim - 1)
    if low == high:
        high += 0.001  # NOTE: transformers' guard against a zero-width ramp
    ramp = ((torch.arange(cfg.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = cfg.theta ** (torch.arange(0, cfg.dim, 2).to(dtype=torch.float) / cfg.dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (cfg.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """positions [T] -> (cos, sin) [T, dim/2] float32."""

    def __init__(self, cfg: RopeConfig, device: torch.device | str) -> None:
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, dim/2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, fused: bool = True
) -> torch.Tensor:
    """x [T, heads, dim] rotated by cos/sin [T, dim/2]; computed in float32, returned as x.dtype
    (fused: by fused_ops' one kernel where the tensors take it)."""
    if fused and fused_ops.supports(x, cos, sin):
        return fused_ops.rotary(x, cos, sin, interleaved)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, dim/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
