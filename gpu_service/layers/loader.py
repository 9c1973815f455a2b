"""Non-expert weights from a checkpoint onto the model's device and dtype.

Tensors are found through model.safetensors.index.json when present, else by scanning *.safetensors;
in a GGUF checkpoint by their Hugging Face names (ktserve.gguf), each dequantized as it is read.
Every read names the shape the config implies and fails with `TensorShapeMismatch` otherwise;
block-scaled FP8 weights (DeepSeek-V3: `<name>_scale_inv`) are dequantized before the cast.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_service.layers.sharding import SINGLE, Shard, TensorParallel, take_shard
from gpu_service.layers.weight_formats import LinearQuantConfig
from ktserve.checkpoint import (
    DEFAULT_FP8_BLOCK,
    CheckpointError,
    InvalidConfig,
    TensorShapeMismatch,
)
from ktserve.checkpoint.fp8 import dequantize_fp8_blocks
from ktserve.checkpoint.fp8 import scale_name as fp8_scale_name
from ktserve.checkpoint.tensor_files import TensorFiles


class MissingTensor(CheckpointError):
    def __init__(self, path: Path | str, name: str) -> None:
        super().__init__(
            f"checkpoint {path} has no tensor {name}, which the config implies; the checkpoint is "
            "incomplete or does not match config.json"
        )


class WeightLoader:
    """Reads named tensors, checks their shape, and places them as `dtype` on `device`;
    linear_quant: the format the families' linear layers take (Linear.load); tp: the rank's
    place in the tensor-parallel group, whose shards the families ask for (parallel.py)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device | str,
        dtype: torch.dtype,
        fp8_block: tuple[int, int] | None = None,
        linear_quant: LinearQuantConfig | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.fp8_block = fp8_block or DEFAULT_FP8_BLOCK
        self.linear_quant = linear_quant or LinearQuantConfig()
        self.tp = tp
        self._files = TensorFiles(self.model_dir)

    def has(self, name: str) -> bool:
        return name in self._files

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
        shard: Shard | None = None,
    ) -> torch.Tensor:
        """Tensor `name` of `shape`, as `dtype` (default: the model dtype) on the device; with
        `shard`, only that part of it (cut on the host: the device never holds the rest)."""
        if name not in self._files:
            raise MissingTensor(self.model_dir, name)
        tensor_slice = self._handle(name).get_slice(name)
        found = tuple(tensor_slice.get_shape())
        if found != tuple(shape):
            raise TensorShapeMismatch(self.model_dir, name, tuple(shape), found)
        tensor = tensor_slice[:]
        if tensor.dtype == torch.float8_e4m3fn:
            scale_name = fp8_scale_name(name)
            if scale_name not in self._files:
                raise MissingTensor(self.model_dir, scale_name)
            scale = self._handle(scale_name).get_tensor(scale_name)
            try:
                tensor = dequantize_fp8_blocks(tensor, scale, self.fp8_block)
            except ValueError as exc:
                raise InvalidConfig(self.model_dir, f"{scale_name}: {exc}") from exc
        tensor = take_shard(tensor, shard, name)
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def _handle(self, name: str):
        return self._files.handle(name)
