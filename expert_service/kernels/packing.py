"""Quantize and pack expert weights into the kernel's layout (one layout per format, any ISA).

The layout (blocks of 16 output rows in AMX B-tile order, gate and up blocks interleaved) is drawn
in ktk.h. Every buffer is a 2-D array [E, per-expert elements], so an expert range is a row slice.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from expert_service.kernels import _ext
from expert_service.kernels.arrays import (
    DT_BF16,
    DT_F8E4M3,
    DT_F16,
    DT_F32,
    aligned_empty,
    is_torch_tensor,
    raw,
)
from ktserve.packed_layout import INT4_GROUP, padded, tensor_specs  # noqa: F401 - re-exported


class WeightFormat(enum.StrEnum):
    BF16 = "bf16"
    INT8 = "int8"  # symmetric, one fp32 scale per output row
    INT4 = "int4"  # symmetric, one bf16 scale per 32 inputs (group along K) per output row


# NOTE: codes match KTK_FMT_* in ktk.h.
FORMAT_CODES = {WeightFormat.BF16: 0, WeightFormat.INT8: 1, WeightFormat.INT4: 2}


@dataclass(frozen=True)
class PackedExperts:
    """Packed weights of E experts (hidden H, intermediate I) in one format."""

    fmt: WeightFormat
    num_experts: int
    hidden_size: int
    intermediate_size: int
    tensors: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", WeightFormat(self.fmt))
        if min(self.num_experts, self.hidden_size, self.intermediate_size) <= 0:
            raise ValueError("num_experts, hidden_size and intermediate_size must be positive")
        specs = tensor_specs(self.fmt, self.hidden_size, self.intermediate_size)
        if set(self.tensors) != set(specs):
            raise ValueError(
                f"{self.fmt} needs tensors {sorted(specs)}, got {sorted(self.tensors)}"
            )
        for name, (dtype, per_expert) in specs.items():
            t = self.tensors[name]
            want = (self.num_experts, per_expert)
            if not isinstance(t, np.ndarray) or t.dtype != dtype or t.shape != want:
                got = (getattr(t, "dtype", type(t).__name__), getattr(t, "shape", None))
                raise ValueError(f"tensor {name!r} must be {dtype} {want}, got {got}")
            if not t.flags.c_contiguous:
                raise ValueError(f"tensor {name!r} must be C-contiguous")

    @classmethod
    def from_tensors(
        cls,
        fmt: WeightFormat | str,
        E: int,
        H: int,
        I: int,  # noqa: E741
        tensors: dict[str, np.ndarray],
    ) -> PackedExperts:
        """Wraps existing buffers (e.g. memory-mapped) without copying; checks shapes and dtypes."""
        return cls(WeightFormat(fmt), E, H, I, dict(tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def expert_nbytes(self) -> int:
        return self.nbytes // self.num_experts

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int, int, int, int]:
        """Addresses of w13, w2, s13, s2, r13, r2 (0 where the format has no such buffer)."""
        t = self.tensors
        return tuple(
            t[n].ctypes.data if n in t else 0 for n in ("w13", "w2", "s13", "s2", "r13", "r2")
        )


def _source(obj: Any, name: str) -> Any:
    """A contiguous CPU buffer of a float dtype the packer reads (f32, bf16 or f16)."""
    if is_torch_tensor(obj):
        import torch

        t = obj.detach().cpu()
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            t = t.float()
        return t.contiguous()
    arr = np.asarray(obj)
    if arr.dtype not in (np.float32, np.float16):
        arr = arr.astype(np.float32)
    return np.ascontiguousarray(arr)


def pack_experts(
    gate: Any,
    up: Any,
    down: Any,
    fmt: WeightFormat | str,
    num_threads: int | None = None,
    out: dict[str, np.ndarray] | None = None,
) -> PackedExperts:
    """Quantizes and packs gate, up [E, I, H] and down [E, H, I] (torch tensors or numpy arrays)."""
    fmt = WeightFormat(fmt)
    srcs = [raw(_source(a, n), n) for a, n in ((gate, "gate"), (up, "up"), (down, "down"))]
    if len({s.kind for s in srcs}) != 1:  # mixed dtypes: read all three as fp32
        srcs = [raw(_source(np.asarray(_to_f32(a)), n), n) for a, n in zip((gate, up, down), "gud")]
    g, u, d = srcs
    if len(g.shape) != 3 or g.shape != u.shape:
        raise ValueError(
            f"gate and up must have the same shape [E, I, H], got {g.shape}, {u.shape}"
        )
    E, I, H = g.shape  # noqa: E741
    if d.shape != (E, H, I):
        raise ValueError(f"down must be [E, H, I] = {(E, H, I)}, got {d.shape}")
    return _pack(fmt, E, H, I, g.kind, num_threads, stacked=(g.ptr, u.ptr, d.ptr), out=out)


_SOURCE_DTYPES = {"f32": DT_F32, "bf16": DT_BF16, "f16": DT_F16, "f8e4m3": DT_F8E4M3}


Triple = tuple[int, int, int]


def _pack(fmt: WeightFormat, E: int, H: int, I: int, kind: str, num_threads: int | None,  # noqa: E741
          *, stacked: Triple = (0, 0, 0), per_expert: Triple = (0, 0, 0),
          scales: Triple = (0, 0, 0), block: tuple[int, int] = (0, 0),
          out: dict[str, np.ndarray] | None = None) -> PackedExperts:  # fmt: skip
    """The packed buffers, filled by ktk_pack from stacked sources or per-expert pointer arrays
    (addresses; see ktk.h); into `out` where given (checked like PackedExperts' tensors)."""
    if out is not None:
        tensors = PackedExperts(fmt, E, H, I, dict(out)).tensors  # NOTE: checks shapes, dtypes
        if any(not t.flags.writeable for t in tensors.values()):
            raise ValueError("the output buffers must be writable")
    else:
        tensors = {n: aligned_empty((E, k), dt) for n, (dt, k) in tensor_specs(fmt, H, I).items()}
    ptr = {n: t.ctypes.data for n, t in tensors.items()}
    _ext.pack(
        FORMAT_CODES[fmt], E, H, I, _SOURCE_DTYPES[kind], *stacked,
        ptr["w13"], ptr["w2"], ptr.get("s13", 0), ptr.get("s2", 0), ptr.get("r13", 0),
        ptr.get("r2", 0), num_threads or len(os.sched_getaffinity(0)), *per_expert, *scales,
        *block,
    )  # fmt: skip
    return PackedExperts(fmt, E, H, I, tensors)


def pack_expert_list(
    experts: Sequence[tuple[Any, Any, Any]],
    fmt: WeightFormat | str,
    *,
    scales: Sequence[tuple[Any, Any, Any]] | None = None,
    block: tuple[int, int] | None = None,
    num_threads: int | None = None,
    out: dict[str, np.ndarray] | None = None,
) -> PackedExperts:
    """Packs one (gate [I, H], up [I, H], down [H, I]) per expert, each read where it lies (a
    tensor of a memory-mapped checkpoint: no stacked copy). All of one dtype: f32, bf16, f16, or
    float8_e4m3fn with `scales` (fp32 per `block` of rows x cols, DeepSeek's weight_scale_inv),
    dequantized while packing. Gives what pack_experts gives for the stacked float32 weights.
    out: buffers to pack into (e.g. a writable mapping of a store file), as PackedExperts holds."""
    fmt = WeightFormat(fmt)
    if not experts:
        raise ValueError("no experts to pack")
    srcs = [tuple(raw(t, n) for t, n in zip(e, ("gate", "up", "down"))) for e in experts]
    kinds = {s.kind for e in srcs for s in e}
    if len(kinds) != 1 or next(iter(kinds)) not in _SOURCE_DTYPES:
        raise ValueError(f"experts must share one of {sorted(_SOURCE_DTYPES)}, got {kinds}")
    kind = kinds.pop()
    I, H = srcs[0][0].shape  # noqa: E741
    for g, u, d in srcs:
        if g.shape != (I, H) or u.shape != (I, H) or d.shape != (H, I):
            raise ValueError(
                f"every expert needs gate, up [{I}, {H}] and down [{H}, {I}], got {g.shape}, "
                f"{u.shape}, {d.shape}"
            )
    E = len(srcs)
    pointers = np.array([[s.ptr for s in e] for e in srcs], dtype=np.uint64).T.copy()  # [3, E]
    scale_ptrs, scale_arrays = np.zeros((3, E), dtype=np.uint64), []
    if kind == "f8e4m3":
        if scales is None or block is None or len(scales) != E:
            raise ValueError("float8 experts need one (gate, up, down) scale triple each and block")
        rows = [(I, H), (I, H), (H, I)]
        for e, triple in enumerate(scales):
            for m, (s, (r, c)) in enumerate(zip(triple, rows)):
                want = (-(-r // block[0]), -(-c // block[1]))
                rs = raw(np.ascontiguousarray(_to_f32(s)), "scale")  # NOTE: keeps its buffer
                if rs.shape != want:
                    raise ValueError(f"expert {e}: scales must be float32 {want}, got {rs}")
                scale_ptrs[m, e] = rs.ptr
                scale_arrays.append(rs)
    fp8 = kind == "f8e4m3"
    return _pack(
        fmt, E, H, I, kind, num_threads,
        per_expert=tuple(int(pointers[m].ctypes.data) for m in range(3)),
        scales=tuple(int(scale_ptrs[m].ctypes.data) if fp8 else 0 for m in range(3)),
        block=block if fp8 else (0, 0), out=out,
    )  # fmt: skip


def _to_f32(obj: Any) -> Any:
    return (
        obj.detach().float().cpu().numpy() if is_torch_tensor(obj) else np.asarray(obj, np.float32)
    )
