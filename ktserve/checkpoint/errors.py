"""Errors met while reading a Hugging Face MoE checkpoint, each with a message a user can act on."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """Base class: the checkpoint (or the shard asked of it) cannot be used as it is."""


class CheckpointDirNotFound(CheckpointError):
    def __init__(self, path: Path) -> None:
        what = "is not a directory" if path.exists() else "does not exist"
        super().__init__(
            f"checkpoint directory {path} {what}; expected a Hugging Face model directory "
            "holding config.json and *.safetensors files"
        )


class ConfigNotFound(CheckpointError):
    def __init__(self, path: Path) -> None:
        super().__init__(
            f"no config.json in checkpoint directory {path}; expected a Hugging Face model "
            "directory holding config.json and *.safetensors files"
        )


class InvalidConfig(CheckpointError):
    def __init__(self, path: Path | str, reason: str) -> None:
        self.reason = reason
        super().__init__(f"config {path} cannot be used: {reason}")


class SafetensorsNotFound(CheckpointError):
    def __init__(self, path: Path, detail: str = "") -> None:
        found = detail or "found no *.safetensors file"
        super().__init__(
            f"checkpoint directory {path}: {found}; expected the model weights as *.safetensors "
            "(convert .bin/.pt checkpoints to safetensors first)"
        )


class NotAnMoEModel(CheckpointError):
    def __init__(self, path: Path | str, model_type: str, reason: str) -> None:
        super().__init__(
            f"config {path} describes model_type {model_type!r}, which is not a Mixture-of-Experts "
            f"model: {reason}; the expert worker serves only routed experts of MoE models"
        )


class UnsupportedArchitecture(CheckpointError):
    def __init__(self, path: Path | str, model_type: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"config {path} has model_type {model_type!r}, which is not supported; "
            f"supported model types: {', '.join(supported)}"
        )


class TensorShapeMismatch(CheckpointError):
    def __init__(
        self, path: Path | str, name: str, expected: tuple[int, ...], found: tuple[int, ...]
    ) -> None:
        super().__init__(
            f"tensor {name} in {path} has shape {list(found)} but the config implies "
            f"{list(expected)}; the weights do not match config.json"
        )


class MissingExpertTensor(CheckpointError):
    def __init__(self, path: Path | str, name: str, alternatives: tuple[str, ...] = ()) -> None:
        alt = f" (nor the fused form {', '.join(alternatives)})" if alternatives else ""
        super().__init__(
            f"checkpoint {path} has no tensor {name}{alt}; the checkpoint is incomplete"
        )


class UnsupportedTensorDtype(CheckpointError):
    def __init__(self, path: Path | str, name: str, dtype: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"tensor {name} in {path} has dtype {dtype}; supported: {', '.join(supported)}"
        )


class InvalidExpertRange(CheckpointError):
    def __init__(self, text: str, reason: str) -> None:
        super().__init__(
            f"expert range {text!r} is not valid: {reason}; expected 'FIRST-LAST' "
            "(inclusive, e.g. '0-63') or a single expert id"
        )


class ShardOutOfRange(CheckpointError):
    def __init__(self, what: str, value: str, num: int) -> None:
        super().__init__(
            f"{what} {value} is outside [0, {num}): the model has {num} routed experts"
        )


class LayerHasNoExperts(CheckpointError):
    def __init__(self, layer: int, moe_layers: tuple[int, ...]) -> None:
        shown = ", ".join(map(str, moe_layers[:8])) + (", ..." if len(moe_layers) > 8 else "")
        super().__init__(f"layer {layer} has no routed experts; MoE layers are: {shown}")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB ({num_bytes} bytes)"


class InsufficientMemory(CheckpointError):
    def __init__(self, required_bytes: int, available_bytes: int, source: str) -> None:
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        super().__init__(
            f"not enough host memory for the expert shard: it needs {_gib(required_bytes)} "
            f"but only "
            f"{_gib(available_bytes)} is available ({source}); load a smaller expert range, "
            "use a smaller format, or free memory"
        )
