"""Model families (DeepSeek-V2/V3, Qwen2/3-MoE, Mixtral) read straight from Hugging Face
checkpoints, with routed experts behind the `RoutedExperts` interface and a paged KV cache."""

from gpu_service.attention.batch import Batch, SeqInput
from gpu_service.experts.routed import PendingExperts, RoutedExperts, TorchExperts
from gpu_service.kvcache.kv_cache import KVCache, KVCacheConfig, KVCacheFull, SeqCache
from gpu_service.layers.loader import MissingTensor
from gpu_service.models.model import CausalLM
from gpu_service.models.registry import SUPPORTED_MODEL_TYPES, load_model

__all__ = [
    "Batch",
    "CausalLM",
    "KVCache",
    "KVCacheConfig",
    "KVCacheFull",
    "MissingTensor",
    "PendingExperts",
    "RoutedExperts",
    "SUPPORTED_MODEL_TYPES",
    "SeqCache",
    "SeqInput",
    "TorchExperts",
    "load_model",
]
