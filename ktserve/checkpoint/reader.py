"""Read routed-expert weights from a Hugging Face MoE checkpoint directory (safetensors, mmap) or
a GGUF checkpoint (ktserve.gguf: each expert dequantized to float32 as it is read).

Two layouts of a layer's experts are understood (see ModelSpec):
  per-expert  ...experts.E.{gate,up,down}_proj.weight (Mixtral: ...experts.E.{w1,w3,w2}.weight)
  fused       ...mlp.experts.gate_up_proj [E, 2I, H] and ...mlp.experts.down_proj [E, H, I]
Storage dtypes: bf16, fp16, fp32, and float8_e4m3fn with `<name>_scale_inv` block scales; a
GGUF's experts come per expert, whatever their GGUF type (tensor_files.TensorFiles).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ktserve.checkpoint.errors import (
    MissingExpertTensor,
    TensorShapeMismatch,
    UnsupportedTensorDtype,
)
from ktserve.checkpoint.fp8 import dequantize_fp8_blocks, fp8_scale_shape
from ktserve.checkpoint.fp8 import scale_name as fp8_scale_name
from ktserve.checkpoint.spec import DEFAULT_FP8_BLOCK, ModelSpec
from ktserve.checkpoint.tensor_files import TensorFiles
from ktserve.names import FLOAT_DTYPES, FP8_SAFETENSORS

_SUPPORTED_DTYPES = (*(d.safetensors for d in FLOAT_DTYPES), FP8_SAFETENSORS)

# progress(done, total) after each expert read.
ProgressCallback = Callable[[int, int], None]
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StoredExperts:
    """Experts' weights as a checkpoint stores them (CheckpointReader.stored_experts)."""

    weights: list[ExpertWeights]  # (gate [I, H], up [I, H], down [H, I]) per expert
    scales: list[ExpertWeights] | None  # float8 only: float32 block scales, the same way
    block: tuple[int, int]  # (rows, cols) of an FP8 scale block


class CheckpointReader:
    """Index of a checkpoint's tensors; reads one expert (or a batch of experts) on demand."""

    def __init__(self, model_dir: str | Path, spec: ModelSpec | None = None) -> None:
        """spec: the checkpoint's ModelSpec when the caller has read config.json already."""
        self.model_dir = Path(model_dir)
        self.spec = spec or ModelSpec.from_checkpoint(self.model_dir)
        self._tensor_files = TensorFiles(self.model_dir)
        self._layouts: dict[int, str] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._tensor_files.close()

    @property
    def dequantizes(self) -> bool:
        """Whether every read dequantizes (a GGUF checkpoint): no tensor is mapped as stored."""
        return self._tensor_files.gguf is not None

    @property
    def block_size(self) -> tuple[int, int]:
        return self.spec.weight_block_size or DEFAULT_FP8_BLOCK

    def has_tensor(self, name: str) -> bool:
        return name in self._tensor_files

    def expert_layout(self, layer: int) -> str:
        """'per_expert' or 'fused': how this checkpoint stores the experts of `layer`."""
        self.spec.check_expert(layer, 0)
        if layer not in self._layouts:
            gate_name = self.spec.expert_tensor_names(layer, 0)[0]
            gate_up_name = self.spec.fused_tensor_names(layer)[0]
            if gate_name in self._tensor_files:
                self._layouts[layer] = "per_expert"
            elif gate_up_name in self._tensor_files:
                self._layouts[layer] = "fused"
            else:
                raise MissingExpertTensor(self.model_dir, gate_name, (gate_up_name,))
        return self._layouts[layer]

    def read_expert(
        self, layer: int, expert: int, dtype: torch.dtype = torch.float32
    ) -> ExpertWeights:
        """(gate [I, H], up [I, H], down [H, I]) of one expert, converted to `dtype`."""
        self.spec.check_expert(layer, expert)
        hidden, inter = self.spec.hidden_size, self.spec.moe_intermediate_size
        if self.expert_layout(layer) == "per_expert":
            gate_name, up_name, down_name = self.spec.expert_tensor_names(layer, expert)
            gate = self._read(gate_name, (inter, hidden))
            up = self._read(up_name, (inter, hidden))
            down = self._read(down_name, (hidden, inter))
        else:
            gate_up_name, down_name = self.spec.fused_tensor_names(layer)
            gate_up = self._read(gate_up_name, (2 * inter, hidden), expert=expert, halves=2)
            gate, up = gate_up[:inter], gate_up[inter:]
            down = self._read(down_name, (hidden, inter), expert=expert)
        return gate.to(dtype), up.to(dtype), down.to(dtype)

    def read_experts(
        self,
        layer: int,
        expert_ids: Sequence[int],
        dtype: torch.dtype = torch.float32,
        progress: ProgressCallback | None = None,
    ) -> ExpertWeights:
        """(gate [n, I, H], up [n, I, H], down [n, H, I]) for `expert_ids`, in that order."""
        for expert in expert_ids:
            self.spec.check_expert(layer, expert)
        num, hidden, inter = len(expert_ids), self.spec.hidden_size, self.spec.moe_intermediate_size
        gates = torch.empty((num, inter, hidden), dtype=dtype)
        ups = torch.empty((num, inter, hidden), dtype=dtype)
        downs = torch.empty((num, hidden, inter), dtype=dtype)
        for i, expert in enumerate(expert_ids):
            gates[i], ups[i], downs[i] = self.read_expert(layer, expert, dtype)
            if progress is not None:
                progress(i + 1, num)
        return gates, ups, downs

    def stored_experts(self, layer: int, expert_ids: Sequence[int]) -> StoredExperts | None:
        """Each expert's (gate [I, H], up [I, H], down [H, I]) as stored, for packing with no
        float32 copy: bf16, f16 or f32, or float8_e4m3fn with its block scales as float32 (then
        `scales` holds them, one triple per expert). None where the layer's experts are fused or
        their tensors differ in dtype (read_experts reads those)."""
        for expert in expert_ids:
            self.spec.check_expert(layer, expert)
        if self.expert_layout(layer) != "per_expert":
            return None
        hidden, inter = self.spec.hidden_size, self.spec.moe_intermediate_size
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        weights, scales = [], []
        for expert in expert_ids:
            names = self.spec.expert_tensor_names(layer, expert)
            triple = tuple(self._read(n, s, dequantize=False) for n, s in zip(names, shapes))
            if len({t.dtype for t in triple}) != 1:
                return None
            weights.append(triple)
            if triple[0].dtype == torch.float8_e4m3fn:
                scales.append(tuple(self._block_scale(n, s) for n, s in zip(names, shapes)))
        return StoredExperts(weights, scales or None, self.block_size)

    def _block_scale(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """The float32 scale_inv [ceil(rows / bo), ceil(cols / bi)] of the FP8 weight `name`."""
        scale_name = fp8_scale_name(name)
        scale_slice = self._handle(scale_name).get_slice(scale_name)
        found, want = tuple(scale_slice.get_shape()), fp8_scale_shape(shape, self.block_size)
        if found != want:
            raise TensorShapeMismatch(self.model_dir, scale_name, want, found)
        return scale_slice[:].float().contiguous()

    def _handle(self, name: str) -> Any:
        try:
            return self._tensor_files.handle(name)
        except KeyError:
            raise MissingExpertTensor(self.model_dir, name) from None

    def _read(
        self,
        name: str,
        shape: tuple[int, int],
        *,
        expert: int | None = None,
        halves: int = 1,
        dequantize: bool = True,
    ) -> torch.Tensor:
        """One [rows, cols] weight from `name` or `name[expert]`; FP8 comes back as float32
        (as stored with dequantize=False)."""
        expected = shape if expert is None else (self.spec.num_experts, *shape)
        tensor_slice = self._handle(name).get_slice(name)
        found, stored = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
        if found != expected:
            raise TensorShapeMismatch(self.model_dir, name, expected, found)
        if stored not in _SUPPORTED_DTYPES:
            raise UnsupportedTensorDtype(self.model_dir, name, stored, _SUPPORTED_DTYPES)
        weight = tensor_slice[:] if expert is None else tensor_slice[expert : expert + 1][0]
        if stored != FP8_SAFETENSORS or not dequantize:
            return weight
        return self._dequantize(name, weight, expert, halves)

    def _dequantize(
        self, name: str, weight: torch.Tensor, expert: int | None, halves: int
    ) -> torch.Tensor:
        scale_name = fp8_scale_name(name)
        scale_slice = self._handle(scale_name).get_slice(scale_name)
        found = tuple(scale_slice.get_shape())
        lead = () if expert is None else (self.spec.num_experts,)
        whole = (*lead, *fp8_scale_shape(tuple(weight.shape), self.block_size))
        # NOTE: a fused gate_up may carry gate's and up's scales stacked, each blocked on its own.
        rows = weight.shape[0] // halves
        split = (*lead, halves * math.ceil(rows / self.block_size[0]), whole[-1])
        if found not in (whole, split):
            raise TensorShapeMismatch(self.model_dir, scale_name, whole, found)
        scale = scale_slice[:] if expert is None else scale_slice[expert : expert + 1][0]
        if found == whole:
            return dequantize_fp8_blocks(weight, scale, self.block_size)
        parts = zip(weight.split(rows), scale.split(scale.shape[0] // halves), strict=True)
        return torch.cat([dequantize_fp8_blocks(w, s, self.block_size) for w, s in parts])
