"""GGUF checkpoints as users have them (one file, a split set, or a directory of either): opened
and validated before anything loads (container), config.json from the metadata (config), tensors
under the Hugging Face names the families load, dequantized as read (tensors, names), and the
tokenizer and chat template from the metadata (tokenizer). docs/gguf.md says what is served."""

from ktserve.gguf.config import hf_config
from ktserve.gguf.container import GGUFCheckpoint, open_checkpoint
from ktserve.gguf.errors import (
    BigEndianGGUF,
    GGUFError,
    GGUFNotFound,
    GGUFTensorShapeMismatch,
    IncompleteSplitSet,
    InvalidGGUF,
    MissingGGUFKey,
    MissingGGUFTensor,
    UnsupportedGGUFArchitecture,
    UnsupportedGGUFType,
)
from ktserve.gguf.files import gguf_files, is_gguf_path, model_name
from ktserve.gguf.tensors import GGUFTensors

__all__ = [
    "BigEndianGGUF",
    "GGUFCheckpoint",
    "GGUFError",
    "GGUFNotFound",
    "GGUFTensorShapeMismatch",
    "GGUFTensors",
    "IncompleteSplitSet",
    "InvalidGGUF",
    "MissingGGUFKey",
    "MissingGGUFTensor",
    "UnsupportedGGUFArchitecture",
    "UnsupportedGGUFType",
    "gguf_files",
    "hf_config",
    "is_gguf_path",
    "model_name",
    "open_checkpoint",
]
