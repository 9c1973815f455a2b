"""The GPU part's linear layers, one module per weight format (weight_formats.py), and the
factory the families build them through (`Linear.load`).

Kernels, per format and device:
    bf16  F.linear in the model dtype.
    fp8   CUDA with compute capability >= 8.9: up to FP8_WEIGHT_ONLY_MAX_ROWS rows of
          bfloat16/float16 activations (decode), the weight-only Triton kernel
          (weight_only_triton.py: the weights upcast in registers, the activations as they are);
          more rows, torch._scaled_mm, activations quantized per row (token) on the fly, weights
          per output channel, bfloat16 out. Elsewhere: the weight is upcast to the activation
          dtype per call (exact, slow: the reference path).
    int8  CPU: torch._weight_int8pack_mm. CUDA (torch has no weight-only int8 kernel there):
          the weight-only Triton kernel for bfloat16/float16 activations of up to
          TRITON_INT8_MAX_ROWS rows (decode, small chunks); larger ones, float32, and hosts
          without Triton dequantize the weight per call.
    int4  torch's tinygemm kernels: CUDA torch._weight_int4pack_mm (bfloat16 activations; N a
          multiple of 8, K of 32), CPU torch._weight_int4pack_mm_for_cpu (N a multiple of 16);
          both need groups of >= 32 inputs. Other shapes dequantize per call.
Every path computes x @ dequantize(W)^T (+ b) up to its own rounding; fp8 on _scaled_mm adds
the activations' quantization. Each CUDA kernel is run once per device on a small case against
dequantization before it is used; one that fails or disagrees logs a warning and its format
dequantizes per call instead.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.layers import weight_only_triton
from gpu_service.layers.weight_formats import (
    FP8_MAX,
    MIN_SCALE,
    Int4Weight,
    LinearQuantConfig,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from gpu_service.layers.weight_only_triton import weight_only_mm

log = logging.getLogger("ktserve.gpu")
TRITON_INT8_MAX_ROWS = 128  # above, dequantizing once and one cuBLAS matmul is the cheaper
# above, _scaled_mm's FP8 tensor cores beat reading the weights once (prompt chunks)
FP8_WEIGHT_ONLY_MAX_ROWS = 16

if TYPE_CHECKING:
    from gpu_service.layers.loader import WeightLoader
    from gpu_service.layers.sharding import Shard


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
        quantize: bool = True,
        shard: Shard | None = None,
    ) -> nn.Module:
        """`prefix`.weight [out, in] (and .bias) in the loader's GPU weight format, or in the
        model dtype when quantize=False (routers' and gates' linears); with `shard`, only that
        part of the weight (and of the bias, when the shard splits the outputs): quantized
        formats quantize the part."""
        return cls.load_stacked(loader, [(prefix, out_features, shard)], in_features, bias=bias,
                                quantize=quantize)  # fmt: skip

    @classmethod
    def load_stacked(
        cls,
        loader: WeightLoader,
        parts: list[tuple[str, int, Shard | None]],
        in_features: int,
        *,
        bias: bool = False,
        quantize: bool = True,
    ) -> nn.Module:
        """Linears of one input as one, their outputs concatenated in order (one GEMM where
        there were several): parts = [(prefix, out_features, shard)], each loaded as load()
        says, then stacked and put in the format as one weight (every format quantizes per
        output row, so each part's rows come out as they would alone)."""
        fmt = loader.linear_quant.format if quantize else "bf16"
        dtype = None if fmt == "bf16" else torch.float32
        weights, biases = [], []
        for prefix, out_features, shard in parts:
            weights.append(loader.get(f"{prefix}.weight", (out_features, in_features), dtype,
                                      shard=shard))  # fmt: skip
            if bias:
                bias_shard = shard if shard is not None and shard.dim == 0 else None
                biases.append(loader.get(f"{prefix}.bias", (out_features,), shard=bias_shard))
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        b = None if not bias else biases[0] if len(biases) == 1 else torch.cat(biases)
        del weights
        if fmt == "bf16":
            return cls(weight, b)
        return make_linear(weight, b, fmt, loader.dtype)

    kernel_name = "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype
) -> nn.Module:
    """The module of format `fmt` for weight [N, K] (any float dtype, on the target device) in
    a model of activation dtype `dtype`."""
    LinearQuantConfig(fmt)  # checks the name
    if fmt == "bf16":
        return Linear(weight.to(dtype), bias)
    if fmt == "fp8":
        return FP8Linear(*quantize_fp8(weight), bias)
    if fmt == "int8":
        return Int8Linear(*quantize_int8(weight, dtype), bias)
    return Int4Linear(quantize_int4(weight, int4_scale_dtype(weight.device, dtype)), bias)


def int4_scale_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """CUDA's int4 kernel takes bfloat16 scales (and activations) whatever the model dtype."""
    return torch.bfloat16 if device.type == "cuda" else dtype


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


@functools.cache
def fp8_matmul_supported(device: torch.device) -> bool:
    """FP8 matrix units (Ada, Hopper, Blackwell: compute capability >= 8.9) and a
    torch._scaled_mm that runs on them and agrees with the upcast path on a small case."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    return _kernel_agrees("torch._scaled_mm (fp8)", device, _fp8_probe)


def _fp8_probe(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_fp8(w)
    return fp8_scaled_mm(x, q, scale), x.float() @ dequantize_fp8(q, scale).T


def _int4_probe(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = quantize_int4(w, torch.bfloat16)
    packed = torch._convert_weight_to_int4pack(weight.packed, _inner_k_tiles(w.shape[1]))
    sz = torch.stack((weight.scale, weight.zero), dim=-1).transpose(0, 1).contiguous()
    return torch._weight_int4pack_mm(x, packed, weight.group_size, sz), x.float() @ (
        dequantize_int4(weight).T
    )


@functools.cache
def int4_mm_supported(device: torch.device) -> bool:
    """torch's CUDA tinygemm kernel runs here and agrees with dequantization on a small case."""
    return device.type == "cuda" and _kernel_agrees("torch._weight_int4pack_mm", device,
                                                    _int4_probe)  # fmt: skip


def _weight_only_probe(weight_dtype: torch.dtype):
    def probe(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weight_dtype == torch.int8:
            q, scale = quantize_int8(w, x.dtype)
            deq = dequantize_int8(q, scale)
        else:
            q, scale = quantize_fp8(w)
            deq = dequantize_fp8(q, scale)
        return weight_only_mm(x, q, scale), x.float() @ deq.T

    return probe


@functools.cache
def weight_only_supported(device: torch.device, weight_dtype: torch.dtype) -> bool:
    """The weight-only Triton matmul (weight_only_triton.py) runs here for int8 or fp8 weights
    and agrees with dequantization on a small case."""
    if device.type != "cuda" or weight_only_triton.triton is None:
        return False
    name = f"the weight-only Triton matmul ({str(weight_dtype).removeprefix('torch.')})"
    fallback = "dequantizing per call" if weight_dtype == torch.int8 else "_scaled_mm for every row"
    return _kernel_agrees(name, device, _weight_only_probe(weight_dtype), fallback)


def _kernel_agrees(name: str, device: torch.device, probe,
                   fallback: str = "dequantizing per call") -> bool:  # fmt: skip
    try:
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(5, 256, generator=gen, device=device).bfloat16()
        w = torch.randn(64, 256, generator=gen, device=device) * 0.02
        got, want = probe(x, w)
        err = float((got.float() - want).norm() / want.norm())
    except Exception as exc:  # noqa: BLE001 - any failure means the per-call fallback
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.warning("%s is unavailable here (%s): %s", name, reason, fallback)
        return False
    if err > 0.1:
        log.warning("%s disagrees with dequantization (%.2e): %s", name, err, fallback)
        return False
    return True


def fp8_scaled_mm(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ (q * scale)^T with x2 quantized per row to e4m3; bfloat16 [M, N]."""
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :],
                            out_dtype=torch.bfloat16)  # fmt: skip


class FP8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q)  # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", scale.float())  # [N]
        self.register_buffer("bias", bias)
        dims_ok = self.out_features % 16 == 0 and self.in_features % 16 == 0
        self.scaled_mm = fp8_matmul_supported(q.device) and dims_ok
        self.weight_only = self.scaled_mm and weight_only_supported(q.device, q.dtype)
        self.kernel_name = (
            "weight_only+scaled_mm" if self.weight_only else "scaled_mm" if self.scaled_mm
            else "upcast"
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.weight_only and rows <= FP8_WEIGHT_ONLY_MAX_ROWS and x.dtype != torch.float32:
            y = weight_only_mm(_flat(x), self.weight, self.weight_scale)
            return _add_bias(y.view(*x.shape[:-1], self.out_features), self.bias)
        if not self.scaled_mm:
            y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
            return _add_bias(y, self.bias)
        y = fp8_scaled_mm(_flat(x), self.weight, self.weight_scale)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return _add_bias(y, self.bias)


class Int8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q)  # [N, K] int8
        self.register_buffer("weight_scale", scale)  # [N], model dtype
        self.register_buffer("bias", bias)
        self.int8pack_mm = q.device.type == "cpu"
        half = scale.dtype in (torch.bfloat16, torch.float16)
        self.triton = half and weight_only_supported(q.device, q.dtype)
        self.kernel_name = (
            "int8pack_mm" if self.int8pack_mm else "triton" if self.triton else "dequantize"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.int8pack_mm:
            y = torch._weight_int8pack_mm(_flat(x), self.weight, self.weight_scale.to(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.triton and rows <= TRITON_INT8_MAX_ROWS and x.dtype == self.weight_scale.dtype:
            y = weight_only_mm(_flat(x), self.weight, self.weight_scale)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        return _add_bias(y, self.bias)


def _inner_k_tiles(in_features: int) -> int | None:
    """tinygemm's innerKTiles for K inputs: the largest of 8, 4, 2 with K % (16 * it) == 0."""
    return next((t for t in (8, 4, 2) if in_features % (16 * t) == 0), None)


class Int4Linear(nn.Module):
    """Weights packed for the device's tinygemm kernel; scale_and_zero [K / g, N, 2]."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.packed.shape[0]
        self.in_features = weight.packed.shape[1] * 2
        self.group_size = weight.group_size
        device = weight.packed.device
        tiles = _inner_k_tiles(self.in_features)
        self.kernel = None
        if self.group_size < 32:
            packed = weight.packed
        elif device.type == "cpu" and self.out_features % 16 == 0:
            packed = torch._convert_weight_to_int4pack_for_cpu(weight.unpacked(), 1)
            self.kernel = torch._weight_int4pack_mm_for_cpu
        elif (
            device.type == "cuda"
            and tiles is not None
            and self.out_features % 8 == 0
            and int4_mm_supported(device)
        ):
            packed = torch._convert_weight_to_int4pack(weight.packed, tiles)
            self.kernel = torch._weight_int4pack_mm
        else:
            packed = weight.packed
        self.kernel_name = self.kernel.__name__ if self.kernel is not None else "dequantize"
        self.register_buffer("weight", packed)
        self.register_buffer("scale_and_zero",
                             torch.stack((weight.scale, weight.zero), dim=-1).transpose(0, 1)
                             .contiguous())  # fmt: skip
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            y = F.linear(x, self._dequantized().to(x.dtype))
            return _add_bias(y, self.bias)
        dtype = self.scale_and_zero.dtype
        y = self.kernel(_flat(x).to(dtype), self.weight, self.group_size, self.scale_and_zero)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return _add_bias(y, self.bias)

    def _dequantized(self) -> torch.Tensor:
        scale, zero = self.scale_and_zero.transpose(0, 1).unbind(-1)  # [N, G] each
        return dequantize_int4(Int4Weight(self.weight, scale, zero, self.group_size))
