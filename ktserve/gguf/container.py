"""Open a GGUF checkpoint (one file or a split set), memory-mapped, and validate it before
anything loads: magic, version and byte order, that the metadata parses, each tensor's type is
one ktserve reads, its rows are whole blocks, its offset is aligned and its data lies inside its
file, and that a split set is whole (split.no / split.count / split.tensors.count).

gguf.GGUFReader parses; `_CheckedReader` checks each tensor's header before the reader maps it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor

from ktserve.gguf.errors import (
    BigEndianGGUF,
    GGUFError,
    IncompleteSplitSet,
    InvalidGGUF,
    MissingGGUFKey,
    UnsupportedGGUFType,
)
from ktserve.gguf.files import gguf_files
from ktserve.gguf.quant_types import READABLE_TYPES, readable_type_names

MAGIC = b"GGUF"
VERSIONS = (2, 3)
_HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError)


def check_header(path: Path) -> None:
    """Magic, version and byte order of one file, from its first bytes."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if head[:4] != MAGIC:
        raise InvalidGGUF(path, f"it starts with {head[:4]!r}, not the GGUF magic {MAGIC!r}")
    if len(head) < _HEADER_BYTES:
        raise InvalidGGUF(path, f"truncated: the file ends inside its header ({len(head)} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if version not in VERSIONS and int.from_bytes(head[4:8], "big") in VERSIONS:
        raise BigEndianGGUF(path)
    if version not in VERSIONS:
        raise InvalidGGUF(path, f"GGUF version {version}; ktserve reads versions 2 and 3")


class _CheckedReader(GGUFReader):
    """GGUFReader that checks every tensor's header before mapping its data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_size = len(self.data)
        for info in fields:
            _, name_bytes, _, dims, raw_type, offset = info.parts
            name = bytes(name_bytes).decode("utf-8", "replace")
            qtype = _readable_type(self.path, name, int(raw_type[0]))
            block, type_size = GGML_QUANT_SIZES[qtype]
            row = int(dims[0]) if len(dims) else 1
            if row % block:
                raise InvalidGGUF(self.path, f"tensor {name}: its rows of {row} values are not "
                                             f"whole {qtype.name} blocks of {block}")  # fmt: skip
            if int(offset[0]) % self.alignment:
                raise InvalidGGUF(self.path, f"tensor {name}: its data offset {int(offset[0])} "
                                             f"is not a multiple of the file's alignment "
                                             f"{self.alignment}")  # fmt: skip
            end = start_offs + int(offset[0]) + math.prod(map(int, dims)) // block * type_size
            if end > file_size:
                raise InvalidGGUF(self.path, f"truncated: tensor {name} ends at byte {end}, the "
                                             f"file has {file_size}")  # fmt: skip
        super()._build_tensors(start_offs, fields)


def _readable_type(path: Path, name: str, raw: int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(raw)
    except ValueError:
        raise UnsupportedGGUFType(path, name, f"ggml type {raw} (unknown)",
                                  readable_type_names()) from None  # fmt: skip
    if qtype not in READABLE_TYPES:
        raise UnsupportedGGUFType(path, name, qtype.name, readable_type_names())
    return qtype


def read_file(path: Path) -> GGUFReader:
    """One file parsed and checked (its tensors memory-mapped, nothing copied)."""
    check_header(path)
    try:
        return _CheckedReader(path)
    except GGUFError:
        raise
    except _PARSE_ERRORS as exc:
        raise InvalidGGUF(path, f"truncated or corrupt metadata ({exc})") from None


@dataclass
class GGUFCheckpoint:
    """The files of one GGUF checkpoint, opened: metadata from the first file (decoded on
    demand), every tensor by its GGUF name, whichever file holds it."""

    path: Path  # the first file
    files: tuple[Path, ...]
    readers: tuple[GGUFReader, ...]
    tensors: dict[str, ReaderTensor]
    _values: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def architecture(self) -> str:
        return self.str("general.architecture")

    def has(self, key: str) -> bool:
        return key in self.readers[0].fields

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (strings, numbers, lists), or default when absent."""
        if key not in self._values:
            item = self.readers[0].fields.get(key)
            if item is None:
                return default
            self._values[key] = item.contents()
        return self._values[key]

    def str(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise MissingGGUFKey(self.path, key)
        return value

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.tensors[name].tensor_type)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def nbytes(self, name: str) -> int:
        return int(self.tensors[name].n_bytes)


def open_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """Open and validate the GGUF checkpoint `path` names (file, any file of a split set, or a
    directory); one per process for the same unchanged files (the mappings are shared)."""
    files = tuple(gguf_files(path))
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    with _lock:
        if key not in _opened:
            _opened.clear()  # NOTE: one checkpoint a process: a stale mapping is let go
            _opened[key] = _open(files)
        return _opened[key]


_opened: dict[tuple, GGUFCheckpoint] = {}
_lock = threading.Lock()


def _open(files: tuple[Path, ...]) -> GGUFCheckpoint:
    readers = tuple(read_file(f) for f in files)
    _check_split_set(files, readers)
    tensors: dict[str, ReaderTensor] = {}
    for file, reader in zip(files, readers):
        for tensor in reader.tensors:
            if tensor.name in tensors:
                raise InvalidGGUF(file, f"tensor {tensor.name} is in more than one file of the set")
            tensors[tensor.name] = tensor
    checkpoint = GGUFCheckpoint(files[0], files, readers, tensors)
    checkpoint.str("general.architecture")  # NOTE: a file without one is refused here
    return checkpoint


def _field(reader: GGUFReader, key: str) -> Any:
    item = reader.fields.get(key)
    return None if item is None else item.contents()


def _check_split_set(files: tuple[Path, ...], readers: tuple[GGUFReader, ...]) -> None:
    count = _field(readers[0], "split.count")
    if count is None:
        if len(files) > 1:
            raise IncompleteSplitSet(files[0], "its first file has no split.count")
        return
    if count != len(files):
        raise IncompleteSplitSet(files[0], f"split.count says {count} files, found {len(files)}")
    for index, (file, reader) in enumerate(zip(files, readers)):
        number = _field(reader, "split.no")
        if number != index:
            raise IncompleteSplitSet(file, f"{file.name} is split.no {number}, expected {index}")
    total = _field(readers[0], "split.tensors.count")
    found = sum(len(r.tensors) for r in readers)
    if total is not None and total != found:
        raise IncompleteSplitSet(
            files[0], f"split.tensors.count is {total}, the files hold {found}"
        )


def dequantize(checkpoint: GGUFCheckpoint, name: str, index: int | None = None) -> np.ndarray:
    """Tensor `name` (or its slice `index` along the first dimension) as float32, in torch
    order."""
    from gguf.quants import dequantize as gguf_dequantize

    tensor = checkpoint.tensors[name]
    data = tensor.data if index is None else tensor.data[index]
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype == GGMLQuantizationType.F32:
        return np.array(data, dtype=np.float32)
    return gguf_dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)
