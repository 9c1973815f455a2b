"""The int4 format's dequantization as one Triton kernel (CUDA): each program reads one group
of 32 along K of one 16-row block (256 bytes, 16 bf16 scales) and writes its 16 x 32 weights,
once, in the compute dtype: ~2.6 bytes of memory traffic per weight where the torch ops take
~20. Layout and arithmetic as dequant.py's `_rows_int4` (float32 product, one rounding); the
tests compare the two under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_int4(w_ptr, s_ptr, out_ptr, expert_bytes, expert_scales, K, G,
                  OUT_BF16: tl.constexpr):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # block of 16 output rows
    g = tl.program_id(2)  # group of 32 along K
    r = tl.arange(0, 16)[:, None]
    t = tl.arange(0, 32)[None, :]  # k % 32
    quad = t // 4
    at = e * expert_bytes + j * 8 * K + g * 256 + (quad % 4) * 64 + r * 4 + t % 4
    byte = tl.load(w_ptr + at).to(tl.int32)
    nibble = tl.where(quad < 4, byte & 15, byte >> 4)
    scale = tl.load(s_ptr + e * expert_scales + (j * G + g) * 16 + r).to(tl.float32)  # [16, 1]
    w = (nibble.to(tl.float32) - 8.0) * scale
    rows = j * 16 + r
    dst = out_ptr + e * (expert_bytes // 8 * 16) + rows * K + g * 32 + t
    if OUT_BF16:  # NOTE: rounded to nearest even by hand, the same on the GPU and interpreted
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(dst, bits.to(tl.int16))
    else:
        tl.store(dst, w)


def rows_int4(w: torch.Tensor, s: torch.Tensor, num_blocks: int, k: int,
              work: torch.dtype) -> torch.Tensor:  # fmt: skip
    """uint8 [E, nb*8*k] and bf16 bit patterns (int16) [E, nb*(k/32)*16] -> `work`
    [E, nb*16, k] (work: bfloat16 or float32)."""
    e = w.shape[0]
    bf16 = work == torch.bfloat16
    out = torch.empty(e, num_blocks * 16, k, dtype=torch.int16 if bf16 else work, device=w.device)
    if e:
        grid = (e, num_blocks, k // 32)
        _dequant_int4[grid](w, s.view(torch.bfloat16), out, w.shape[1], s.shape[1], k, k // 32,
                            OUT_BF16=bf16)  # fmt: skip
    return out.view(torch.bfloat16) if bf16 else out
