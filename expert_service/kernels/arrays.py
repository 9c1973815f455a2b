"""Raw views of numpy arrays and CPU torch tensors (no libtorch linkage: data_ptr only)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

# NOTE: codes match KTK_DT_* in ktk.h.
DT_F32, DT_BF16, DT_F16, DT_F8E4M3 = 0, 1, 2, 3


@dataclass(frozen=True)
class RawArray:
    """Address, element kind and shape of a C-contiguous CPU buffer."""

    ptr: int
    kind: str  # "f32", "bf16", "f16", "i32", "u16", ...
    shape: tuple[int, ...]
    owner: Any  # keeps the memory alive


_NUMPY_KINDS = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(np.uint16): "bf16",  # bf16 passed as raw uint16
    np.dtype(np.int32): "i32",
    np.dtype(np.float64): "f64",
}


@functools.cache
def _torch_kinds() -> dict[Any, str]:
    import torch

    return {
        torch.float32: "f32",
        torch.bfloat16: "bf16",
        torch.float16: "f16",
        torch.int32: "i32",
        torch.float64: "f64",
        torch.uint16: "bf16",
        torch.float8_e4m3fn: "f8e4m3",
    }


def _torch_kind(t: Any) -> str:
    return _torch_kinds().get(t.dtype, str(t.dtype))


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def raw(obj: Any, name: str) -> RawArray:
    """A raw view of obj; raises ValueError unless it is a C-contiguous CPU array or tensor."""
    if is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {obj.device}")
        if not obj.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        return RawArray(obj.data_ptr(), _torch_kind(obj), tuple(obj.shape), obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        kind = _NUMPY_KINDS.get(obj.dtype, str(obj.dtype))
        return RawArray(obj.ctypes.data, kind, obj.shape, obj)
    raise ValueError(
        f"{name} must be a numpy array or a CPU torch tensor, got {type(obj).__name__}"
    )


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type, align: int = 64) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(nbytes + align, dtype=np.uint8)
    start = (-buf.ctypes.data) % align
    return buf[start : start + nbytes].view(dtype).reshape(shape)
