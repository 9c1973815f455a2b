"""The packed expert buffers' names, dtypes and sizes per format: what the worker's kernel
packs (expert_service/kernels/ktk.h draws the layout inside them) and what a GPU service that
maps a worker's packed store checks it against."""

from __future__ import annotations

import numpy as np

INT4_GROUP = 32
PACK_ALIGN = 64  # H and I are padded to a multiple of this (ktk.h: Hp, Ip)


def padded(n: int) -> int:
    return (n + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN


def tensor_specs(fmt: str, H: int, I: int) -> dict[str, tuple[np.dtype, int]]:  # noqa: E741
    """name -> (dtype, elements per expert) of every packed buffer of one format."""
    Hp, Ip = padded(H), padded(I)
    if fmt == "bf16":
        return {"w13": (np.dtype(np.uint16), 2 * Ip * Hp), "w2": (np.dtype(np.uint16), Hp * Ip)}
    if fmt == "int8":
        return {
            "w13": (np.dtype(np.int8), 2 * Ip * Hp),
            "w2": (np.dtype(np.int8), Hp * Ip),
            "s13": (np.dtype(np.float32), 2 * Ip),
            "s2": (np.dtype(np.float32), Hp),
            "r13": (np.dtype(np.int32), 2 * Ip),
            "r2": (np.dtype(np.int32), Hp),
        }
    if fmt != "int4":
        raise ValueError(f"unknown weight format {fmt!r}; expected bf16, int8 or int4")
    return {
        "w13": (np.dtype(np.uint8), Ip * Hp),
        "w2": (np.dtype(np.uint8), Hp * Ip // 2),
        "s13": (np.dtype(np.uint16), 2 * Ip * Hp // INT4_GROUP),
        "s2": (np.dtype(np.uint16), Hp * Ip // INT4_GROUP),
    }
