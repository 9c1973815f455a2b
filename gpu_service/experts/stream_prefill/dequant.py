"""The worker's packed expert formats (expert_service/kernels/ktk.h) turned back into weight
matrices with torch ops, on whatever device the packed bytes sit (the GPU, or the CPU in tests).

Per expert, blocks of 16 output rows over the padded K (Hp = roundup(H, 64), Ip = roundup(I, 64)):
    bf16  uint16 [K/2][16][2]        element (k, r) at (k/2)*32 + r*2 + k%2
    int8  int8   [K/4][16][4]        element (k, r) at (k/4)*64 + r*4 + k%4;  w = q * s[row] (fp32)
    int4  uint8  [K/32][4][64]       byte g*256 + (q%4)*64 + r*4 + k%4 of quad q = (k%32)/4 holds
                                     it in the low (q < 4) or high (q >= 4) nibble, as value + 8;
                                     w = (nibble - 8) * s[block][g][r] (bf16, per group of 32 in K)
    w13: 2*Ip/16 blocks over K = Hp, block 2b = gate rows 16b.., 2b+1 = up rows 16b..
    w2:  Hp/16 blocks over K = Ip (down rows)
Products are formed in float32 (exact for int4 and bf16: a 4-bit integer times a bf16 scale),
then rounded to the compute dtype; for bfloat16 compute, int4 and bf16 are dequantized in bf16
directly (the same values, half the memory traffic). On CUDA, int4 goes through one Triton
kernel where Triton is installed (int4_triton.py: the same values again).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("ktserve.gpu")

FORMATS = ("bf16", "int8", "int4")


def padded(n: int) -> int:
    return (n + 63) // 64 * 64


def _rows_bf16(w: torch.Tensor, num_blocks: int, k: int, work: torch.dtype) -> torch.Tensor:
    """uint16 [E, num_blocks * 16 * k] -> `work` [E, num_blocks * 16, k]."""
    e = w.shape[0]
    blocks = w.view(e, num_blocks, k // 2, 16, 2).permute(0, 1, 3, 2, 4)  # [E, nb, 16, K/2, 2]
    rows = blocks.reshape(e, num_blocks * 16, k)
    return rows.view(torch.bfloat16) if work == torch.bfloat16 else bf16_bits_to_float(rows)


def _rows_int8(w: torch.Tensor, s: torch.Tensor, num_blocks: int, k: int) -> torch.Tensor:
    """int8 [E, nb*16*k] and fp32 row scales [E, nb*16] -> float32 [E, nb*16, k]."""
    e = w.shape[0]
    blocks = w.view(e, num_blocks, k // 4, 16, 4).permute(0, 1, 3, 2, 4)  # [E, nb, 16, K/4, 4]
    q = blocks.reshape(e, num_blocks * 16, k).to(torch.float32)
    return q * s.view(e, num_blocks * 16, 1)


def _rows_int4(w: torch.Tensor, s: torch.Tensor, num_blocks: int, k: int,
               work: torch.dtype) -> torch.Tensor:  # fmt: skip
    """uint8 [E, nb*8*k] and bf16 (uint16) group scales [E, nb*(k/32)*16] -> `work`
    [E, nb*16, k]."""
    e, groups = w.shape[0], k // 32
    b = w.view(e, num_blocks, groups, 4, 16, 4)  # [E, nb, G, q%4, r, k%4]
    nibbles = torch.stack((b & 0x0F, b >> 4), dim=3)  # [E, nb, G, hi, q%4, r, k%4]
    q = nibbles.permute(0, 1, 5, 2, 3, 4, 6).reshape(e, num_blocks * 16, groups, 32)
    q = q.to(work) - 8  # [E, rows, G, 32], exact in bf16 too
    scale = _rows_scales(s, work).view(e, num_blocks, groups, 16).permute(0, 1, 3, 2)
    return (q * scale.reshape(e, num_blocks * 16, groups, 1)).view(e, num_blocks * 16, k)


def _rows_scales(s: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    return s.view(torch.bfloat16) if work == torch.bfloat16 else bf16_bits_to_float(s)


def bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (uint16, any shape) -> float32 (exact: the high half of the word)."""
    words = torch.zeros((*bits.shape, 2), dtype=torch.int16, device=bits.device)
    words[..., 1] = bits.view(torch.int16)  # NOTE: little endian: [1] is the high half
    return words.view(torch.float32).squeeze(-1)


def _rows(fmt: str, tensors: dict[str, torch.Tensor], which: str, num_blocks: int, k: int,
          work: torch.dtype):  # fmt: skip
    w = tensors[f"w{which}"]
    if fmt == "bf16":
        return _rows_bf16(w, num_blocks, k, work)
    if fmt == "int8":
        return _rows_int8(w, tensors[f"s{which}"], num_blocks, k)
    if fmt == "int4":
        s = tensors[f"s{which}"]
        if w.device.type == "cuda" and _triton_int4() is not None:
            try:
                return _triton_int4()(w, s, num_blocks, k, work)
            except Exception:  # noqa: BLE001 - a Triton that cannot build it here: torch ops
                log.exception("the Triton int4 dequantization failed; using torch ops")
                _TRITON["rows_int4"] = None
        return _rows_int4(w, s, num_blocks, k, work)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


_TRITON: dict = {}


def _triton_int4():
    """int4_triton.rows_int4 (one kernel on CUDA), or None without Triton."""
    if "rows_int4" not in _TRITON:
        try:
            from gpu_service.experts.stream_prefill.int4_triton import rows_int4
        except ImportError:
            rows_int4 = None
        _TRITON["rows_int4"] = rows_int4
    return _TRITON["rows_int4"]


def dequantize(fmt: str, tensors: dict[str, torch.Tensor], hidden: int, inter: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Packed experts (rows [E, per-expert] of w13, w2 and their scales) -> (w13 [E, 2I, H]:
    gate rows then up rows, w2 [E, H, I]: down), in `dtype`, on the tensors' device."""
    hp, ip = padded(hidden), padded(inter)
    # NOTE: uint16 has few CUDA kernels (no index_select, say): bit patterns travel as int16
    tensors = {n: t.view(torch.int16) if t.dtype == torch.uint16 else t for n, t in tensors.items()}
    # NOTE: a bf16 weight, and a 4-bit integer times a bf16 scale, are exact in float32 and
    # correctly rounded by one bf16 multiply: bf16 work gives float32 work rounded to bf16
    work = torch.bfloat16 if dtype == torch.bfloat16 and fmt != "int8" else torch.float32
    rows13 = _rows(fmt, tensors, "13", 2 * ip // 16, hp, work)  # [E, 2Ip, Hp], gate/up mixed
    e = rows13.shape[0]
    pairs = rows13.view(e, ip // 16, 2, 16, hp)  # [E, Ip/16, gate|up, 16, Hp]
    gate = pairs[:, :, 0].reshape(e, ip, hp)[:, :inter, :hidden]
    up = pairs[:, :, 1].reshape(e, ip, hp)[:, :inter, :hidden]
    w13 = torch.cat((gate, up), dim=1).to(dtype)  # [E, 2I, H]
    down = _rows(fmt, tensors, "2", hp // 16, ip, work)[:, :hidden, :inter].to(dtype)  # [E, H, I]
    return w13, down
