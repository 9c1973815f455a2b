"""Assemble the GPU service: the model's GPU part, its routed-experts backend, the KV cache
sized to the memory left, and the engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from gpu_service.config import GPUServiceConfig
from gpu_service.engine import DecodeGraphConfig, Engine, EngineMetrics
from gpu_service.gpu_experts import (
    HotExpertRefresher,
    HybridExperts,
    choose_hot_experts,
    worker_activation_counts,
)
from gpu_service.models import KVCache, load_model
from gpu_service.models.registry import default_device
from gpu_service.moe_client import ShmExperts
from ktserve.checkpoint import CheckpointReader, HFConfig, ModelSpec
from ktserve.names import float_dtype

log = logging.getLogger("ktserve.gpu")

CPU_DEFAULT_CACHE_TOKENS = 32768


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA, float32 elsewhere (bfloat16 matmuls on CPUs without native
    support made prefill 7x slower than float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return float_dtype(name).torch()


@dataclass
class GPUService:
    config: GPUServiceConfig
    engine: Engine
    experts: ShmExperts
    metrics: EngineMetrics
    max_model_len: int
    refresher: HotExpertRefresher | None = None

    def close(self) -> None:
        if self.refresher is not None:
            self.refresher.stop()
        self.engine.stop()
        self.experts.close()


def build_gpu_service(config: GPUServiceConfig, eos_token_ids=(), decode=None,
                      hf: HFConfig | None = None) -> GPUService:  # fmt: skip
    """hf: the checkpoint's config.json when the caller has read it already."""
    hf = hf or HFConfig.from_dir(config.model_dir)
    spec = ModelSpec.from_hf(hf)
    device = torch.device(config.device) if config.device else default_device()
    dtype = resolve_dtype(config.dtype, device)
    scheduler = config.scheduler
    max_model_len = scheduler.max_model_len or min(hf.int("max_position_embeddings", 4096), 8192)
    scheduler = replace(scheduler, max_model_len=max_model_len)
    check_model_fits(config, spec)
    experts = ShmExperts(
        config.experts, hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok,
        max_tokens=max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs), device=device,
    )  # fmt: skip
    try:
        backend = experts
        if config.gpu_experts or config.expert_placement:
            backend = _hybrid(config, spec, experts, device, dtype)
        deferred = config.max_deferred_experts_per_token
        model = load_model(config.model_dir, device, dtype, experts=backend,
                           max_num_tokens_in_cache=16, hf=hf,
                           max_deferred_experts_per_token=deferred)  # fmt: skip
        tokens = config.kv_cache_tokens or _cache_tokens(model.kv_cache, dtype, device, config)
        per_token = model.kv_cache.config.bytes_per_token(dtype)
        host_tokens = int(config.kv_host_cache_gib * 2**30) // per_token
        cache_config = replace(model.kv_cache.config, max_num_tokens=tokens,
                               enable_prefix_caching=config.prefix_caching,
                               max_num_host_tokens=host_tokens)  # fmt: skip
        model.kv_cache = KVCache(cache_config, dtype, device)
        log.info("KV cache: %d tokens (%.2f GiB), prefix caching %s%s", tokens,
                 tokens * per_token / 2**30, "on" if config.prefix_caching else "off",
                 f", host tier {host_tokens} tokens" if host_tokens else "")  # fmt: skip
        graphs = None
        if device.type == "cuda" and config.cuda_graphs:
            max_batch = min(config.cuda_graph_max_batch, scheduler.max_num_seqs)
            graphs = DecodeGraphConfig(max_batch=max_batch,
                                       experts_in_graph=config.graph_expert_calls)  # fmt: skip
        metrics = EngineMetrics(max_model_len=max_model_len)
        experts.on_round_trip = metrics.moe_round_trip.observe
        engine = Engine(model, scheduler, eos_token_ids=eos_token_ids, decode=decode,
                        metrics=metrics, experts_stats=experts.stats,
                        graph_config=graphs).start()  # fmt: skip
        refresher = None
        refresh = config.gpu_experts_refresh_s > 0 and not config.expert_placement
        if isinstance(backend, HybridExperts) and refresh:
            refresher = HotExpertRefresher(backend, config.gpu_experts,
                                           config.gpu_experts_refresh_s).start()  # fmt: skip
    except BaseException:
        experts.close()
        raise
    return GPUService(config, engine, experts, metrics, max_model_len, refresher)


def check_model_fits(config: GPUServiceConfig, spec: ModelSpec) -> None:
    """Raises ValueError for settings this model cannot take (before anything is loaded)."""
    deferred = config.max_deferred_experts_per_token
    if deferred >= spec.num_experts_per_tok:
        raise ValueError(
            f"--max-deferred-experts-per-token must be below the model's "
            f"{spec.num_experts_per_tok} routed experts per token, got {deferred}"
        )


def _hybrid(config: GPUServiceConfig, spec: ModelSpec, experts: ShmExperts,
            device: torch.device, dtype: torch.dtype) -> HybridExperts:  # fmt: skip
    reader = CheckpointReader(config.model_dir, spec=spec)
    hot = choose_hot_experts(
        spec.moe_layers, spec.num_experts, config.gpu_experts or 1,
        counts=worker_activation_counts(experts), placement_file=config.expert_placement,
    )  # fmt: skip
    log.info("GPU experts: %d per layer", len(next(iter(hot.values()))))
    return HybridExperts(experts, reader, hot, device, dtype)


def _cache_tokens(cache: KVCache, dtype: torch.dtype, device: torch.device,
                  config: GPUServiceConfig) -> int:  # fmt: skip
    if device.type != "cuda":
        return CPU_DEFAULT_CACHE_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    per_token = cache.config.bytes_per_token(dtype)
    tokens = int(free * config.gpu_memory_fraction) // per_token
    if tokens < 16:
        raise RuntimeError(
            f"only {free / 2**30:.2f} GiB of GPU memory is free after the weights: too little "
            "for a KV cache; lower the model size or free the GPU"
        )
    return tokens
