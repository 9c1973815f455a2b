"""The GPU part's weight formats: their config, and how a weight W [N, K] (N outputs, K inputs)
is quantized into each and dequantized back (plain torch: the reference every kernel matches).

    fp8   q float8_e4m3fn [N, K], scale float32 [N]:           W ~ q * scale[:, None]
    int8  q int8 [N, K], scale [N] (model dtype):              W ~ q * scale[:, None]
    int4  q uint4 [N, K] packed two per byte, groups of g inputs (g = 128, or the largest power
          of two below it that divides K), scale and zero [N, K / g] (model dtype):
          W ~ (q - 8) * scale + zero   (tinygemm's convention, which torch's int4 kernels take)
          packed [N, K / 2] uint8: byte j = q[:, 2j] << 4 | q[:, 2j + 1]

Scales are rounded to the dtype they are stored in before q is computed, so the dequantized
weight is exactly what the kernels multiply by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_service.config import GPU_WEIGHT_FORMATS

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_GROUP_SIZE = 128
MIN_SCALE = 1e-12


@dataclass(frozen=True)
class LinearQuantConfig:
    """How the GPU part stores its linear layers' weights.

    format: bf16 keeps them unquantized in the model dtype (float32 on the CPU); fp8, int8 and
    int4 quantize them at load. quantize_lm_head: the output head too (routers, norms and the
    embedding table always stay in the model dtype).
    """

    format: str = "bf16"
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.format not in GPU_WEIGHT_FORMATS:
            raise ValueError(
                f"GPU weight format must be one of {GPU_WEIGHT_FORMATS}, got {self.format!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], scale float32 [N]), per output channel."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)  # [N]
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale [N] as scale_dtype), symmetric per output channel."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127).clamp(min=MIN_SCALE).to(scale_dtype)  # [N]
    q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def int4_group_size(in_features: int) -> int:
    """128, or the largest power of two below it that divides in_features (>= 2)."""
    group = INT4_GROUP_SIZE
    while group > 2 and in_features % group:
        group //= 2
    if in_features % group:
        raise ValueError(f"int4 needs an even number of inputs, got {in_features}")
    return group


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # [N, K / 2] uint8
    scale: torch.Tensor  # [N, K / g]
    zero: torch.Tensor  # [N, K / g]
    group_size: int

    def unpacked(self) -> torch.Tensor:
        """q [N, K] int32 in [0, 15]."""
        high, low = (self.packed >> 4).int(), (self.packed & 0xF).int()
        return torch.stack((high, low), dim=-1).flatten(1)


def quantize_int4(w: torch.Tensor, scale_dtype: torch.dtype) -> Int4Weight:
    """Asymmetric 4-bit groups of int4_group_size(K) inputs (min..max over 16 levels)."""
    n, k = w.shape
    group = int4_group_size(k)
    wg = w.float().view(n, k // group, group)  # [N, G, g]
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, G]
    scale = ((high - low) / 15).clamp(min=MIN_SCALE).to(scale_dtype)
    zero = (low + 8 * scale.float()).to(scale_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    q = torch.round((wg - z) / s + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    packed = q[:, 0::2] << 4 | q[:, 1::2]
    return Int4Weight(packed.contiguous(), scale, zero, group)


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    q = weight.unpacked().float()
    n, k = q.shape
    g = weight.group_size
    s, z = weight.scale.float()[..., None], weight.zero.float()[..., None]  # [N, G, 1]
    return ((q.view(n, k // g, g) - 8) * s + z).view(n, k)
