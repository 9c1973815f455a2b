"""A worker's packed store, mapped read-only by the GPU service (the worker reports it in
WorkerInfo.store). Nothing it reports is trusted before it is checked:

    the directory  an absolute path, a real directory (no symlink), owned by this uid, writable
                   by no one else
    each file      a plain name inside it, opened O_RDONLY | O_NOFOLLOW, a regular file of the
                   same owner that no one else can write
    each tensor    the names, dtypes and shapes its format has (kernels.packing.tensor_specs for
                   the model's sizes and the worker's expert range), inside its file, aligned

The mapping is MAP_SHARED and PROT_READ: the worker's page cache (or tmpfs) pages, no copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ktserve.names import weight_format_from_pb
from ktserve.packed_layout import tensor_specs
from ktserve.protocol import expert_pb2 as pb


class UntrustedStore(PermissionError):
    """A reported store this process will not map (owner, mode, offsets)."""


@dataclass(frozen=True)
class StoreLayerView:
    """One MoE layer of one worker's store: its tensors [experts held, per expert], read-only
    numpy views of the mapping."""

    layer: int
    experts: range
    tensors: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class MappedStore:
    """Every MoE layer of one worker's store, mapped (see the module docstring)."""

    def __init__(self, info: pb.WorkerInfo, hidden: int, inter: int,
                 moe_layers: tuple[int, ...]) -> None:  # fmt: skip
        if not info.HasField("store"):
            raise UntrustedStore(
                f"worker pid {info.pid} reports no packed store (its experts are in private "
                "memory: started with --no-share-experts, or /dev/shm had no room)"
            )
        self.fmt = weight_format_from_pb(info.format)
        self.experts = range(info.experts.start, info.experts.stop)
        self.dir = Path(info.store.dir)
        self._maps: dict[str, mmap.mmap] = {}
        self.layers: dict[int, StoreLayerView] = {}
        specs = tensor_specs(self.fmt, hidden, inter)
        try:
            _check_owned(self.dir, directory=True)
            for entry in info.store.layers:
                self.layers[entry.layer] = self._layer(entry, specs)
        except BaseException:
            self.close()
            raise
        if set(self.layers) != set(moe_layers):
            self.close()
            raise UntrustedStore(
                f"{self.dir}: layers {sorted(self.layers)}, the model's MoE layers are "
                f"{list(moe_layers)}"
            )

    def _layer(self, entry: pb.StoreLayer, specs: dict) -> StoreLayerView:
        name = entry.file
        if not name or "/" in name or name in (".", ".."):
            raise UntrustedStore(f"{self.dir}: layer {entry.layer}: bad file name {name!r}")
        mm = self._maps.get(name) or self._map(name)
        got = {t.name: t for t in entry.tensors}
        if set(got) != set(specs):
            raise UntrustedStore(
                f"{self.dir}/{name}: tensors {sorted(got)}, {self.fmt} has {sorted(specs)}"
            )
        tensors = {}
        for tname, (dtype, per_expert) in specs.items():
            t = got[tname]
            shape = (len(self.experts), per_expert)
            if np.dtype(t.dtype) != dtype or tuple(t.shape) != shape:
                raise UntrustedStore(
                    f"{self.dir}/{name}: {tname} is {t.dtype} {list(t.shape)}, expected "
                    f"{dtype.str} {list(shape)}"
                )
            nbytes = shape[0] * shape[1] * dtype.itemsize
            if t.offset % dtype.itemsize or t.offset + nbytes > len(mm):
                raise UntrustedStore(
                    f"{self.dir}/{name}: {tname} at offset {t.offset} ({nbytes} bytes) does not "
                    f"lie aligned inside the file's {len(mm)} bytes"
                )
            flat = np.frombuffer(mm, dtype=dtype, count=shape[0] * shape[1], offset=t.offset)
            tensors[tname] = flat.reshape(shape)
        return StoreLayerView(entry.layer, self.experts, tensors)

    def _map(self, name: str) -> mmap.mmap:
        try:
            fd = os.open(self.dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # NOTE: ELOOP: a symlink
            raise UntrustedStore(f"{self.dir / name}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            _check_stat(st, self.dir / name, directory=False)
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[name] = mm
        return mm

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.layers.values())

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each mapped file, for cudaHostRegister."""
        return [(np.frombuffer(mm, np.uint8).ctypes.data, len(mm)) for mm in self._maps.values()]

    def close(self) -> None:
        self.layers.clear()
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):  # NOTE: a view in use keeps it until it goes
                mm.close()
        self._maps.clear()


def _check_owned(path: Path, directory: bool) -> None:
    if not path.is_absolute():
        raise UntrustedStore(f"store directory {str(path)!r} is not an absolute path")
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UntrustedStore(f"store directory {path}: {exc.strerror}") from exc
    _check_stat(st, path, directory)


def _check_stat(st: os.stat_result, path: Path, directory: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise UntrustedStore(f"{path} is not a {'directory' if directory else 'regular file'}")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UntrustedStore(
            f"{path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}; this process "
            f"maps only stores of its own uid ({os.geteuid()}) that no one else can write"
        )
