"""Where each tensor of a checkpoint is read from, by its Hugging Face name: a safetensors file
(safe_open, one handle per file, opened on first use) or a GGUF checkpoint (ktserve.gguf's
GGUFTensors, which answers as a safetensors handle does, dequantizing as it reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import safe_open

from ktserve.checkpoint.safetensors_index import index_tensors


class TensorFiles:
    """name -> a handle with get_slice(name) / get_tensor(name) for the checkpoint at `path`."""

    def __init__(self, path: str | Path) -> None:
        from ktserve.gguf.files import is_gguf_path

        self.path = Path(path)
        self.gguf = None
        if is_gguf_path(self.path):
            from ktserve.gguf.tensors import GGUFTensors

            self.gguf = GGUFTensors(self.path)
            self.files = dict.fromkeys(self.gguf.names(), self.gguf.path)
        else:
            self.files = index_tensors(self.path)
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def handle(self, name: str) -> Any:
        """The handle that reads `name` (KeyError when the checkpoint has no such tensor)."""
        if self.gguf is not None:
            if name not in self.files:
                raise KeyError(name)
            return self.gguf
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def close(self) -> None:
        self._handles.clear()
