"""config.json model_type -> family builder, and `load_model`, the entry point the engine uses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from gpu_service.attention.backend import DEFAULT_BLOCK_SIZE, AttentionBackend
from gpu_service.experts.routed import RoutedExperts
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.sharding import SINGLE, TensorParallel
from gpu_service.layers.weight_formats import LinearQuantConfig
from gpu_service.models import deepseek, glm4_moe, mixtral, qwen_moe
from gpu_service.models.model import CausalLM
from ktserve.checkpoint import HFConfig, ModelSpec, UnsupportedArchitecture

Builder = Callable[
    [HFConfig, ModelSpec, WeightLoader, RoutedExperts, int, int, AttentionBackend], CausalLM
]

MODEL_BUILDERS: dict[str, Builder] = {
    "deepseek_v3": deepseek.build,
    "deepseek_v2": deepseek.build,
    "qwen3_moe": qwen_moe.build,
    "qwen2_moe": qwen_moe.build,
    "mixtral": mixtral.build,
    "glm4_moe": glm4_moe.build,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_BUILDERS)
# NOTE: ModelSpec refuses a model_type outside ktserve's one table of families; every family there
# has a builder here (tests/gpu_service/models/test_models.py checks both lists agree).


def choose_attention(hf: HFConfig, device: torch.device | str, dtype: torch.dtype,
                     kv_dtype: torch.dtype, *, flashmla: bool = True,
                     fused_kernels: bool = True) -> AttentionBackend:  # fmt: skip
    """The attention backend of this model here (AttentionBackend.choose, with its MLA cache
    rows' width): its block_size is the KV cache's (FlashMLA's 64 where it serves the model's MLA
    decode and flashmla allows it, else DEFAULT_BLOCK_SIZE), its mla_decode the kernel that
    leads to, in words ("" for a model without MLA)."""
    mla = MODEL_BUILDERS.get(hf.model_type) is deepseek.build
    width = hf.int("kv_lora_rank") + hf.int("qk_rope_head_dim") if mla else 0
    return AttentionBackend.choose(device, dtype, kv_dtype, width, allow_flashmla=flashmla,
                                   fused_kernels=fused_kernels)  # fmt: skip


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    model_dir: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    experts: RoutedExperts,
    max_num_tokens_in_cache: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    hf: HFConfig | None = None,
    max_deferred_experts_per_token: int = 0,
    linear_quant: LinearQuantConfig | None = None,
    tp: TensorParallel = SINGLE,
    attention: AttentionBackend | None = None,
) -> CausalLM:
    """The model's non-expert part on `device` (default: cuda when available) as `dtype`, with a
    paged KV cache of `max_num_tokens_in_cache` token slots; routed experts go to `experts`.
    hf: the checkpoint's config.json when the caller has read it already.
    max_deferred_experts_per_token: expert deferral (CausalLM.defer_experts; 0: off).
    linear_quant: the GPU weight format of the linear layers (default: the model dtype).
    tp: this rank's share of a tensor-parallel model (layers/parallel.py; default: all of it).
    attention: the kernels of its attention and fused layers, given to each layer as it is built
    (default: choose_attention's for this device and dtype)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"model dtype {dtype} is not supported; use float32, bfloat16 or float16")
    hf = hf or HFConfig.from_checkpoint(model_dir)
    if hf.model_type not in MODEL_BUILDERS:
        raise UnsupportedArchitecture(hf.source, hf.model_type, SUPPORTED_MODEL_TYPES)
    spec = ModelSpec.from_hf(hf)
    device = torch.device(device or default_device())
    attention = attention or choose_attention(hf, device, dtype, dtype)
    loader = WeightLoader(model_dir, device, dtype,
                          fp8_block=spec.weight_block_size, linear_quant=linear_quant,
                          tp=tp)  # fmt: skip
    build = MODEL_BUILDERS[hf.model_type]
    model = build(hf, spec, loader, experts, max_num_tokens_in_cache, block_size, attention)
    model.defer_experts(max_deferred_experts_per_token)
    return model.eval()
