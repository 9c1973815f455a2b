"""Bytes from shapes: the GPU part per weight format (weight_formats.py draws each format), the
KV cache per token (the KVCacheConfig each family's model builds, none allocated), and the
routed experts a CPU worker packs (ktserve.packed_layout)."""

from __future__ import annotations

import torch

from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.layers.weight_formats import int4_group_size
from gpu_service.plan.gpu_tensors import GPUTensor
from gpu_service.workers.plan import split_experts
from ktserve.checkpoint import HFConfig, ModelSpec
from ktserve.packed_layout import tensor_specs


def tensor_bytes(tensor: GPUTensor, fmt: str, dtype: torch.dtype) -> int:
    """Bytes of one GPU tensor with linear layers in `fmt` and the rest in `dtype` (float32
    where its kind says so)."""
    model_size = dtype.itemsize
    if tensor.kind == "fp32":
        return 4 * tensor.num_params
    if tensor.kind == "model" or fmt == "bf16":
        return model_size * tensor.num_params
    n, k = tensor.shape
    if fmt == "fp8":
        return n * k + 4 * n  # q float8 [N, K], scale float32 [N]
    if fmt == "int8":
        return n * k + model_size * n  # q int8 [N, K], scale [N]
    if fmt == "int4":
        groups = k // int4_group_size(k)
        return n * k // 2 + 2 * model_size * n * groups  # packed [N, K/2], scale, zero [N, G]
    raise ValueError(f"unknown GPU weight format {fmt!r}")


def gpu_weight_bytes(tensors: tuple[GPUTensor, ...], fmt: str, dtype: torch.dtype) -> int:
    return sum(tensor_bytes(t, fmt, dtype) for t in tensors)


def kv_cache_config(hf: HFConfig, block_size: int = 16) -> KVCacheConfig:
    """The cache's shape as each family's build makes it (MLA: one latent of kv_lora_rank +
    qk_rope_head_dim per layer; GQA: a key and a value of num_kv_heads x head_dim); one block
    of tokens, as the model is built before the memory plan sizes it."""
    spec = ModelSpec.from_hf(hf)
    if spec.family.startswith("deepseek"):
        entries: tuple[tuple[int, ...], ...] = (
            (hf.int("kv_lora_rank") + hf.int("qk_rope_head_dim"),),
        )
    else:
        heads = hf.int("num_attention_heads")
        head_dim = hf.int("head_dim", hf.int("hidden_size") // heads)
        entry = (hf.int("num_key_value_heads", heads), head_dim)
        entries = (entry, entry)
    return KVCacheConfig(spec.num_layers, entries, block_size, block_size)


def expert_bytes(spec: ModelSpec, fmt: str) -> int:
    """Bytes of one routed expert packed in a CPU worker's format (padded as the kernel packs)."""
    specs = tensor_specs(fmt, spec.hidden_size, spec.moe_intermediate_size)
    return sum(dtype.itemsize * count for dtype, count in specs.values())


def worker_expert_counts(num_experts: int, num_workers: int) -> tuple[int, ...]:
    """Experts per worker under --expert-workers' even split (workers/plan.py split_experts)."""
    counts = []
    for span in split_experts(num_experts, num_workers):
        first, last = (int(x) for x in span.split("-"))
        counts.append(last - first + 1)
    return tuple(counts)
