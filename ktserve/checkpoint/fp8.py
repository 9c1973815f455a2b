"""Block-scaled FP8 weights (DeepSeek-V3): float8_e4m3fn with per-block `weight_scale_inv`.

A weight W [out, in] is q (float8_e4m3fn) plus s = weight_scale_inv [ceil(out/bo), ceil(in/bi)]:
  W[r, c] = float(q[r, c]) * s[r // bo, c // bi]
Blocks at the bottom and right edges are partial when out or in is not a multiple of the block.
"""

from __future__ import annotations

import math

import torch

SCALE_SUFFIX = "_scale_inv"  # tensor `<weight name>_scale_inv` holds an FP8 weight's block scales


def scale_name(weight_name: str) -> str:
    """The name of the FP8 weight `weight_name`'s block scales."""
    return weight_name + SCALE_SUFFIX


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Expected scale shape for an FP8 weight of `shape` (leading dims kept, last two blocked)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 weight from an FP8 `weight` [..., out, in] and its `scale_inv` [..., ob, ib]."""
    if tuple(scale_inv.shape) != fp8_scale_shape(tuple(weight.shape), block):
        raise ValueError(
            f"scale shape {list(scale_inv.shape)} does not fit weight {list(weight.shape)} "
            f"with blocks {list(block)}"
        )
    *lead, rows, cols = weight.shape
    *_, num_row_blocks, num_col_blocks = scale_inv.shape
    bo, bi = block
    padded = weight.new_zeros(
        (*lead, num_row_blocks * bo, num_col_blocks * bi), dtype=torch.float32
    )
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.view(*lead, num_row_blocks, bo, num_col_blocks, bi)  # [.., ob, bo, ib, bi]
    blocks = blocks * scale_inv.float()[..., :, None, :, None]
    blocks = blocks.view(*lead, num_row_blocks * bo, num_col_blocks * bi)
    return blocks[..., :rows, :cols].contiguous()
