"""A GGUF checkpoint's tensors under the Hugging Face names the loaders ask for, dequantized to
float32 one tensor (or one expert) at a time, the converter's permutations and splits undone.

`GGUFTensors.get_slice(name)` answers as safetensors' `safe_open(...).get_slice(name)` does
(get_shape, get_dtype, indexing), so the checkpoint readers take either source the same way.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from ktserve.gguf.container import GGUFCheckpoint, dequantize, open_checkpoint
from ktserve.gguf.errors import GGUFTensorShapeMismatch, MissingGGUFTensor
from ktserve.gguf.names import Source, hf_names_of, joined_kv_b, source_of

log = logging.getLogger("ktserve.gguf")

DEQUANTIZED_DTYPE = "F32"  # what get_dtype answers: every tensor comes back as float32
_PROGRESS_EVERY_S = 10.0


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q_proj / k_proj rows (convert_hf_to_gguf.py's
    `permute`: per head, the rows (pairs, halves) became (halves, pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


class GGUFTensors:
    """The Hugging Face view of one GGUF checkpoint's tensors (see names.py for the mapping)."""

    def __init__(self, path: str | Path) -> None:
        self.checkpoint: GGUFCheckpoint = open_checkpoint(path)
        self.path = self.checkpoint.path
        self.arch = self.checkpoint.architecture
        self._dequantized_bytes = 0
        self._last_report = time.monotonic()

    def names(self) -> list[str]:
        """Every Hugging Face name this checkpoint serves."""
        num_experts = int(self.checkpoint.value(f"{self.arch}.expert_count", 0) or 0)
        return [hf for name in self.checkpoint.tensors
                for hf in hf_names_of(self.arch, name, num_experts)]  # fmt: skip

    def source(self, hf_name: str) -> Source | None:
        """Where `hf_name` lies, or None when this checkpoint does not hold it."""
        source = source_of(self.arch, hf_name)
        if source is None:
            return None
        if all(name in self.checkpoint.tensors for name in source.names):
            return source
        if hf_name.endswith("self_attn.kv_b_proj.weight"):
            joined = joined_kv_b(int(hf_name.split(".")[2]))
            if all(name in self.checkpoint.tensors for name in joined.names):
                return joined
        return None

    def has(self, hf_name: str) -> bool:
        return self.source(hf_name) is not None

    def shape(self, hf_name: str) -> tuple[int, ...]:
        source = self._require(hf_name)
        shapes = [self.checkpoint.shape(name) for name in source.names]
        if source.undo == "expert":
            return shapes[0][1:]
        if source.undo == "join_kv_b":
            (heads, rank, nope), (_, v_dim, _) = shapes  # k_b [h, r, nope], v_b [h, v, r]
            return heads * (nope + v_dim), rank
        if source.undo == "row":
            return 1, int(np.prod(shapes[0]))
        return shapes[0]

    def read(self, hf_name: str) -> torch.Tensor:
        """Tensor `hf_name` as float32, in the Hugging Face layout."""
        source = self._require(hf_name)
        if source.undo == "join_kv_b":
            k_b, v_b = (self._dequantize(name) for name in source.names)
            heads, rank, nope = k_b.shape
            if v_b.shape[0] != heads or v_b.shape[2] != rank:
                want = (heads, v_b.shape[1], rank)
                raise GGUFTensorShapeMismatch(self.path, source.names[1], want, tuple(v_b.shape))
            joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [h, nope + v, r]
            return joined.reshape(-1, rank).contiguous()
        weight = self._dequantize(source.names[0], source.expert)
        if source.undo == "permute_q":
            return unpermute(weight, self._heads("attention.head_count"))
        if source.undo == "permute_k":
            return unpermute(weight, self._heads("attention.head_count_kv", "attention.head_count"))
        if source.undo == "row":
            return weight.reshape(1, -1)
        return weight

    def get_slice(self, hf_name: str) -> GGUFSlice:
        self._require(hf_name)
        return GGUFSlice(self, hf_name)

    def get_tensor(self, hf_name: str) -> torch.Tensor:
        return self.read(hf_name)

    def _require(self, hf_name: str) -> Source:
        source = self.source(hf_name)
        if source is None:
            wanted = source_of(self.arch, hf_name)
            raise MissingGGUFTensor(self.path, wanted.names[0] if wanted else "(none)", hf_name)
        return source

    def _heads(self, key: str, fallback: str | None = None) -> int:
        value = self.checkpoint.value(f"{self.arch}.{key}")
        if value is None and fallback is not None:
            value = self.checkpoint.value(f"{self.arch}.{fallback}")
        return int(value)

    def _dequantize(self, name: str, index: int | None = None) -> torch.Tensor:
        array = dequantize(self.checkpoint, name, index)
        shape = self.checkpoint.shape(name)
        want = shape if index is None else shape[1:]
        if array.shape != want:
            raise GGUFTensorShapeMismatch(self.path, name, want, array.shape)
        self._note_progress(array.nbytes)
        return torch.from_numpy(np.ascontiguousarray(array))

    def _note_progress(self, nbytes: int) -> None:
        self._dequantized_bytes += nbytes
        now = time.monotonic()
        if now - self._last_report >= _PROGRESS_EVERY_S:
            self._last_report = now
            log.info("%s: %.2f GiB dequantized so far", self.path.name,
                     self._dequantized_bytes / 2**30)  # fmt: skip


class GGUFSlice:
    """One tensor as safetensors' slice objects answer: shape and dtype first, data on
    indexing (the whole tensor is dequantized, then indexed)."""

    def __init__(self, tensors: GGUFTensors, hf_name: str) -> None:
        self.tensors = tensors
        self.hf_name = hf_name

    def get_shape(self) -> list[int]:
        return list(self.tensors.shape(self.hf_name))

    def get_dtype(self) -> str:
        return DEQUANTIZED_DTYPE

    def __getitem__(self, key: object) -> torch.Tensor:
        tensor = self.tensors.read(self.hf_name)
        return tensor if key == slice(None) else tensor[key]
