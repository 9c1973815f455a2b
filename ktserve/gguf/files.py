"""Where a GGUF checkpoint's files are: one file, a split set (llama.cpp's gguf-split names them
PREFIX-00001-of-00003.gguf ...), or a directory holding either. Names only; container.py opens
them."""

from __future__ import annotations

import re
from pathlib import Path

from ktserve.gguf.errors import GGUFNotFound, IncompleteSplitSet

SUFFIX = ".gguf"
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf_path(path: str | Path) -> bool:
    """Whether `path` names a GGUF checkpoint: a *.gguf file, or a directory with *.gguf files
    and no config.json (a Hugging Face directory is read as one even beside GGUF files)."""
    path = Path(path)
    if path.suffix == SUFFIX:
        return True
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*" + SUFFIX))


def split_name(path: Path, index: int, count: int) -> Path:
    """The name of file `index` (1-based) of the split set `path` belongs to."""
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not named as a file of a GGUF split set")
    return path.with_name(f"{match['prefix']}-{index:05d}-of-{count:05d}{SUFFIX}")


def gguf_files(path: str | Path) -> list[Path]:
    """The files of the checkpoint `path` names, in split order: [FILE] for a single file, every
    file of a split set for any of its files, the one model (file or set) of a directory."""
    path = Path(path)
    if path.is_dir():
        return _files_in_directory(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise GGUFNotFound(path, what)
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["index"]) <= count:
        raise IncompleteSplitSet(path, f"its name says file {match['index']} of {count}")
    files = [split_name(path, i, count) for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise IncompleteSplitSet(files[0], f"{', '.join(missing)} missing of {count} files")
    return files


def _files_in_directory(path: Path) -> list[Path]:
    found = sorted(path.glob("*" + SUFFIX))
    if not found:
        raise GGUFNotFound(path, "the directory holds no *.gguf file")
    models = {}
    for file in found:
        match = _SPLIT_NAME.match(file.name)
        models.setdefault(match["prefix"] if match else file.stem, file)
    if len(models) > 1:
        raise GGUFNotFound(
            path,
            f"the directory holds several models ({', '.join(sorted(models))}); name the file "
            "(for a split set, its first file)",
        )
    return gguf_files(next(iter(models.values())))


def model_name(path: str | Path) -> str:
    """The name a checkpoint is served as: a directory's own name; a GGUF file's name without
    .gguf and the split suffix."""
    path = Path(path).resolve()
    if path.is_dir():
        return path.name
    match = _SPLIT_NAME.match(path.name)
    return match["prefix"] if match else path.name.removesuffix(SUFFIX)
