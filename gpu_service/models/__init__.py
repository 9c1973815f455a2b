"""Model families (DeepSeek-V2/V3, Qwen2/3-MoE, Mixtral, GLM-4.5) read straight from Hugging Face
checkpoints, with routed experts behind the `RoutedExperts` interface, holding the paged KV
cache's tensors."""

from gpu_service.attention.batch import Batch, SeqInput
from gpu_service.experts.routed import PendingExperts, RoutedExperts, TorchExperts
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.sequence import SeqCache
from gpu_service.kvcache.tensors import KVCacheTensors
from gpu_service.layers.loader import MissingTensor
from gpu_service.models.model import CausalLM
from gpu_service.models.registry import SUPPORTED_MODEL_TYPES, load_model

__all__ = [
    "Batch",
    "CausalLM",
    "KVCacheConfig",
    "KVCacheTensors",
    "MissingTensor",
    "PendingExperts",
    "RoutedExperts",
    "SUPPORTED_MODEL_TYPES",
    "SeqCache",
    "SeqInput",
    "TorchExperts",
    "load_model",
]
