"""Checkpoint reading shared by both services: config.json (read once), the model spec and its
table of families, the safetensors index, FP8 dequantization, expert-range sharding, the errors."""

from ktserve.checkpoint.config_json import HFConfig, read_config_json
from ktserve.checkpoint.errors import (
    CheckpointDirNotFound,
    CheckpointError,
    ConfigNotFound,
    InsufficientMemory,
    InvalidConfig,
    InvalidExpertRange,
    LayerHasNoExperts,
    MissingExpertTensor,
    NotAnMoEModel,
    SafetensorsNotFound,
    ShardOutOfRange,
    TensorShapeMismatch,
    UnsupportedArchitecture,
    UnsupportedTensorDtype,
)
from ktserve.checkpoint.fp8 import dequantize_fp8_blocks, fp8_scale_shape
from ktserve.checkpoint.headers import non_expert_params, tensor_headers
from ktserve.checkpoint.reader import CheckpointReader, ProgressCallback
from ktserve.checkpoint.safetensors_index import index_tensors
from ktserve.checkpoint.sharding import (
    available_memory_bytes,
    check_memory_available,
    estimate_shard_bytes,
    parse_expert_range,
    validate_shard,
)
from ktserve.checkpoint.spec import (
    DEFAULT_FP8_BLOCK,
    FAMILIES,
    SUPPORTED_FAMILIES,
    Family,
    ModelSpec,
)

__all__ = [
    "DEFAULT_FP8_BLOCK",
    "FAMILIES",
    "SUPPORTED_FAMILIES",
    "CheckpointDirNotFound",
    "CheckpointError",
    "CheckpointReader",
    "ConfigNotFound",
    "Family",
    "HFConfig",
    "InsufficientMemory",
    "InvalidConfig",
    "InvalidExpertRange",
    "LayerHasNoExperts",
    "MissingExpertTensor",
    "ModelSpec",
    "NotAnMoEModel",
    "ProgressCallback",
    "SafetensorsNotFound",
    "ShardOutOfRange",
    "TensorShapeMismatch",
    "UnsupportedArchitecture",
    "UnsupportedTensorDtype",
    "available_memory_bytes",
    "check_memory_available",
    "dequantize_fp8_blocks",
    "estimate_shard_bytes",
    "fp8_scale_shape",
    "index_tensors",
    "non_expert_params",
    "parse_expert_range",
    "read_config_json",
    "tensor_headers",
    "validate_shard",
]
