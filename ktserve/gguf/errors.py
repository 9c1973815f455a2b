"""Errors met while opening a GGUF checkpoint, each refused before anything loads and each with a
message a user can act on (they are CheckpointErrors, so both commands print them as one line)."""

from __future__ import annotations

from pathlib import Path

from ktserve.checkpoint.errors import CheckpointError


class GGUFError(CheckpointError):
    """Base class: this GGUF file (or split set) cannot be served as it is."""


class GGUFNotFound(GGUFError):
    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"GGUF checkpoint {path}: {detail}")


class InvalidGGUF(GGUFError):
    """Not a GGUF file, or a damaged one: bad magic, version, truncated, misaligned."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.reason = reason
        super().__init__(f"{path} is not a usable GGUF file: {reason}")


class BigEndianGGUF(GGUFError):
    def __init__(self, path: Path | str) -> None:
        super().__init__(
            f"{path} is a big-endian GGUF file; ktserve reads little-endian GGUF only "
            "(convert it again on a little-endian machine, or with llama.cpp's "
            "gguf_convert_endian.py)"
        )


class IncompleteSplitSet(GGUFError):
    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(
            f"GGUF split set {path} is incomplete: {reason}; every file of the set must sit in "
            "the same directory"
        )


class UnsupportedGGUFArchitecture(GGUFError):
    def __init__(self, path: Path | str, arch: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"{path} holds architecture {arch!r} (general.architecture), which ktserve does not "
            f"serve; served GGUF architectures: {', '.join(supported)}"
        )


class UnsupportedGGUFType(GGUFError):
    def __init__(self, path: Path | str, tensor: str, type_name: str, supported: tuple[str, ...]):
        super().__init__(
            f"tensor {tensor} in {path} is stored as {type_name}, which ktserve cannot read; "
            f"readable types: {', '.join(supported)}"
        )


class MissingGGUFKey(GGUFError):
    def __init__(self, path: Path | str, key: str, why: str = "") -> None:
        super().__init__(
            f"{path} has no metadata key {key}{f' ({why})' if why else ''}; the file is "
            "incomplete or was written by a converter ktserve does not know"
        )


class MissingGGUFTensor(GGUFError):
    def __init__(self, path: Path | str, gguf_name: str, hf_name: str) -> None:
        super().__init__(
            f"{path} has no tensor {gguf_name} (the model's {hf_name}); the file is incomplete "
            "or its architecture's layout is not one ktserve knows"
        )


class GGUFTensorShapeMismatch(GGUFError):
    def __init__(self, path: Path | str, tensor: str, expected: tuple, found: tuple) -> None:
        super().__init__(
            f"tensor {tensor} in {path} has shape {list(found)} but the metadata implies "
            f"{list(expected)}; the tensors do not match the file's metadata"
        )
