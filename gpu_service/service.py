"""Assemble the GPU service: the model's GPU part (its linear layers in the GPU weight format),
its routed-experts backend, the KV cache sized by the memory plan (memory_plan.py), and the
engine."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, replace

import torch

from gpu_service.config import KV_CACHE_DTYPES, GPUServiceConfig
from gpu_service.engine import DecodeGraphConfig, Engine, EngineMetrics
from gpu_service.experts.gpu_experts import (
    HotExpertRefresher,
    HybridExperts,
    choose_hot_experts,
    worker_activation_counts,
)
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.experts.stream_prefill.backend import StreamingExperts
from gpu_service.experts.stream_prefill.build import build_streaming, kv_room_declines
from gpu_service.layers.auto_weight_format import AutoFormat, choose_auto_format
from gpu_service.layers.linear import fp8_matmul_supported
from gpu_service.layers.sharding import SINGLE, TensorParallel
from gpu_service.layers.weight_formats import LinearQuantConfig
from gpu_service.memory_plan import GPUMemoryTooSmall, MemoryPlan, cpu_plan, cuda_plan
from gpu_service.models import KVCacheTensors, load_model
from gpu_service.models.config import model_max_len
from gpu_service.models.registry import choose_attention, default_device
from gpu_service.tensor_parallel.leader import LeaderConfig, TensorParallelLeader, check_devices
from ktserve import envs
from ktserve.checkpoint import CheckpointReader, HFConfig, ModelSpec, non_expert_params
from ktserve.names import float_dtype

log = logging.getLogger("ktserve.gpu")

CPU_DEFAULT_CACHE_TOKENS = 32768


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA, float32 elsewhere (bfloat16 matmuls on CPUs without native
    support made prefill several times slower than float32)."""
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
    memory_plan: MemoryPlan | None = None
    streaming: StreamingExperts | None = None  # prefill through the GPU (--stream-prefill)
    tensor_parallel: TensorParallelLeader | None = None  # its followers (--tensor-parallel-size)

    def close(self) -> None:
        if self.refresher is not None:
            self.refresher.stop()
        self.engine.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        if self.streaming is not None:
            self.streaming.close()
        self.experts.close()
        gc.unfreeze()  # NOTE: its objects in cycles can be collected again (see below)
        if self.engine.model.device.type == "cuda":
            torch.cuda.empty_cache()  # NOTE: another service in this process plans from free memory


def build_gpu_service(config: GPUServiceConfig, eos_token_ids=(), decode=None,
                      hf: HFConfig | None = None) -> GPUService:  # fmt: skip
    """hf: the checkpoint's config.json when the caller has read it already."""
    hf = hf or HFConfig.from_checkpoint(config.model_dir)
    spec = ModelSpec.from_hf(hf)
    device = torch.device(config.device) if config.device else default_device()
    dtype = resolve_dtype(config.dtype, device)
    scheduler = config.scheduler
    check_model_fits(config, spec, hf)
    linear_quant, chosen_by = resolve_linear_quant(config, device)
    experts = ShmExperts(
        config.experts, hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok,
        max_tokens=max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs), device=device,
    )  # fmt: skip
    streaming = leader = None
    try:
        tp = SINGLE
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        attention = choose_attention(hf, device, dtype, kv_dtype, flashmla=config.flashmla,
                                     fused_kernels=config.fused_kernels)  # fmt: skip
        if config.tensor_parallel_size > 1:
            leader = TensorParallelLeader(LeaderConfig(
                config.tensor_parallel_size, config.model_dir, device, dtype,
                linear_quant, attention, config.tensor_parallel_timeout_s,
            ))  # fmt: skip
            tp = leader.start()  # NOTE: the followers load their shares while rank 0 does
        backend = experts
        if config.gpu_experts or config.expert_placement:
            backend = _hybrid(config, spec, experts, device, dtype)
        # NOTE: before the model and the KV cache, so their sizes leave room for its buffers
        streaming = build_streaming(config.stream_prefill, spec, experts, backend, device, dtype,
                                    config.tensor_parallel_size)  # fmt: skip
        hybrid = backend if isinstance(backend, HybridExperts) else None
        backend = streaming or backend
        deferred = config.max_deferred_experts_per_token
        log.info("GPU weight format: %s%s%s", linear_quant.format,
                 " (lm_head too)" if linear_quant.quantize_lm_head else "",
                 f" (auto: {chosen_by})" if chosen_by else "")  # fmt: skip
        if attention.mla_decode:
            log.info("MLA decode: %s", attention.mla_decode)
        block_size = attention.block_size
        model = load_model(config.model_dir, device, dtype, experts=backend,
                           max_num_tokens_in_cache=block_size, block_size=block_size, hf=hf,
                           max_deferred_experts_per_token=deferred,
                           linear_quant=linear_quant, tp=tp, attention=attention)  # fmt: skip
        if leader is not None:
            leader.ready(model)  # NOTE: before the memory plan: its profiling steps are theirs too
        max_graph_batch = min(config.cuda_graph_max_batch, scheduler.max_num_seqs)
        if device.type == "cuda":
            plan, streaming = _cuda_plan(config, hf, model, kv_dtype, max_graph_batch, streaming)
            if streaming is not None:
                streaming.reset_stats()  # NOTE: the plan's profiling prefill streamed
        else:
            plan = cpu_plan(model, config.kv_cache_tokens or CPU_DEFAULT_CACHE_TOKENS, kv_dtype)
        log.info("%s", plan.table())
        tokens = plan.kv_cache_tokens
        per_token = model.kv_cache.config.bytes_per_token(kv_dtype)
        host_tokens = int(config.kv_host_cache_gib * 2**30) // per_token
        cache_config = replace(model.kv_cache.config, max_num_tokens=tokens,
                               enable_prefix_caching=config.prefix_caching,
                               max_num_host_tokens=host_tokens)  # fmt: skip
        model.kv_cache = KVCacheTensors(cache_config, kv_dtype, device)
        if leader is not None:
            leader.sync_cache(model)
        log.info("KV cache: %d tokens (%.2f GiB, %s), prefix caching %s%s", tokens,
                 tokens * per_token / 2**30, str(kv_dtype).removeprefix("torch."),
                 "on" if config.prefix_caching else "off",
                 f", host tier {host_tokens} tokens" if host_tokens else "")  # fmt: skip
        model_max = model_max_len(hf)
        max_model_len = context_length(scheduler.max_model_len, model_max, tokens)
        scheduler = replace(scheduler, max_model_len=max_model_len)
        log.info("context: %d tokens (model max %d; the KV cache holds %d tokens in total)",
                 max_model_len, model_max, tokens)  # fmt: skip
        graphs = None
        if device.type == "cuda" and config.cuda_graphs and leader is not None:
            log.info("CUDA graphs: off with --tensor-parallel-size %d (decode steps run eagerly)",
                     config.tensor_parallel_size)  # fmt: skip
        elif device.type == "cuda" and config.cuda_graphs:
            graphs = DecodeGraphConfig(max_batch=max_graph_batch,
                                       experts_in_graph=config.graph_expert_calls,
                                       chain_steps=config.chain_decode_steps)  # fmt: skip
        metrics = EngineMetrics(max_model_len=max_model_len)
        metrics.observe_memory_plan(plan)
        experts.on_round_trip = metrics.moe_round_trip.observe
        if streaming is not None:
            streaming.on_streamed = metrics.prefill_streamed_tokens.inc
        engine = Engine(model, scheduler, eos_token_ids=eos_token_ids, decode=decode,
                        metrics=metrics, experts_stats=experts.stats,
                        graph_config=graphs).start()  # fmt: skip
        # NOTE: the start-up's objects (the model, its modules, the graphs' state) live as long
        # as the service; frozen, a full collection no longer walks them while steps run
        gc.collect()
        gc.freeze()
        refresher = None
        refresh = config.gpu_experts_refresh_s > 0 and not config.expert_placement
        if hybrid is not None and refresh:
            refresher = HotExpertRefresher(hybrid, config.gpu_experts,
                                           config.gpu_experts_refresh_s).start()  # fmt: skip
    except BaseException:
        if leader is not None:
            leader.close()
        if streaming is not None:
            streaming.close()
        experts.close()
        raise
    return GPUService(config, engine, experts, metrics, max_model_len, refresher, plan, streaming,
                      leader)  # fmt: skip


def resolve_linear_quant(config: GPUServiceConfig,
                         device: torch.device) -> tuple[LinearQuantConfig, str]:  # fmt: skip
    """--gpu-weight-format, auto resolved (auto_weight_format.py: bf16 where the unquantized GPU
    part takes at most half the memory budget, else fp8 on GPUs with FP8 units), and why auto
    chose it ("" for a named format)."""
    fmt, why = config.gpu_weight_format, ""
    if fmt == "auto":
        choice = auto_format(config, device)
        fmt, why = choice.format, choice.reason
        if fmt == "bf16" and config.quantize_lm_head:
            raise ValueError(
                "--quantize-lm-head needs a quantized GPU weight format, and auto chose bf16 "
                "here: name one with --gpu-weight-format fp8|int8|int4"
            )
    return LinearQuantConfig(fmt, config.quantize_lm_head), why


def auto_format(config: GPUServiceConfig, device: torch.device) -> AutoFormat:
    """What --gpu-weight-format auto picks for this checkpoint on this device, and why."""
    if device.type != "cuda":
        return choose_auto_format(0, None, False)
    per_gpu = non_expert_params(config.model_dir) * 2 // config.tensor_parallel_size
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * config.gpu_memory_utilization)
    return choose_auto_format(per_gpu, budget, fp8_matmul_supported(device))


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for a --kv-cache-dtype name."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def context_length(requested: int | None, model_max: int, cache_tokens: int) -> int:
    """--max-model-len, or by default the model's own maximum bounded by the KV cache (one
    sequence may fill it); a requested length the cache cannot hold is a ValueError."""
    if requested is None:
        return min(model_max, cache_tokens)
    if requested > cache_tokens:
        raise ValueError(
            f"--max-model-len {requested} is more than the KV cache holds ({cache_tokens} "
            "tokens): lower --max-model-len, or give the cache more (--kv-cache-tokens, "
            "--kv-cache-dtype fp8)"
        )
    return requested


def _cuda_plan(config: GPUServiceConfig, hf: HFConfig, model, kv_dtype: torch.dtype,
               max_graph_batch: int, streaming: StreamingExperts | None,
               ) -> tuple[MemoryPlan, StreamingExperts | None]:  # fmt: skip
    """The memory plan on CUDA. With --stream-prefill auto, streaming stays only where the KV
    cache the plan leaves beside it holds what the configuration needs (--kv-cache-tokens, or
    one full context: --max-model-len or the model's own); otherwise it is given up (logged),
    the MoE layers call the workers, and the plan is made again without it."""
    scheduler = config.scheduler

    def plan(kv_tokens: int | None, streaming_bytes: int) -> MemoryPlan:
        return cuda_plan(model, kv_dtype, config.gpu_memory_utilization,
                         scheduler.max_num_batched_tokens, max_graph_batch, kv_tokens,
                         scheduler.max_model_len, scheduler.max_num_seqs,
                         streaming_bytes)  # fmt: skip

    if streaming is None or config.stream_prefill != "auto":
        return plan(config.kv_cache_tokens, streaming.memory_bytes if streaming else 0), streaming
    if config.kv_cache_tokens:
        required, required_by = config.kv_cache_tokens, "--kv-cache-tokens"
    else:
        required = scheduler.max_model_len or model_max_len(hf)
        required_by = "one full context"
    try:
        room = plan(None, streaming.memory_bytes).kv_cache_tokens
    except GPUMemoryTooSmall:
        room = 0
    reason = kv_room_declines(room, required, required_by, streaming.memory_bytes)
    if reason is None:
        log.info("prefill: streaming kept: the KV cache beside it holds %d tokens (%s: %d)",
                 room, required_by, required)  # fmt: skip
        return plan(config.kv_cache_tokens, streaming.memory_bytes), streaming
    log.warning("prefill: experts stay on the CPU workers: %s", reason)
    for moe in model.moes:
        if moe.experts is streaming:
            moe.experts = streaming.cpu
    streaming.close()
    return plan(config.kv_cache_tokens, 0), None


def check_model_fits(config: GPUServiceConfig, spec: ModelSpec,
                     hf: HFConfig | None = None) -> None:  # fmt: skip
    """Raises ValueError for settings this model cannot take (before anything is loaded);
    hf: the checkpoint's config.json, for the checks that need more than spec."""
    size = config.tensor_parallel_size
    if size > 1:
        hf = hf or HFConfig.from_checkpoint(config.model_dir)
        tp = TensorParallel(0, size)
        heads = hf.int("num_attention_heads")
        tp.local(heads, "attention heads")
        if not spec.family.startswith("deepseek"):  # NOTE: MLA's latent is not split by heads
            tp.kv_heads(hf.int("num_key_value_heads", heads))
        check_devices(size, torch.device(config.device or default_device()))
    deferred = config.max_deferred_experts_per_token
    if deferred >= spec.num_experts_per_tok:
        raise ValueError(
            f"{envs.MAX_DEFERRED_EXPERTS_PER_TOKEN.name} must be below the model's "
            f"{spec.num_experts_per_tok} routed experts per token, got {deferred}"
        )
    resolve_linear_quant(config, torch.device(config.device or default_device()))


def _hybrid(config: GPUServiceConfig, spec: ModelSpec, experts: ShmExperts,
            device: torch.device, dtype: torch.dtype) -> HybridExperts:  # fmt: skip
    reader = CheckpointReader(config.model_dir, spec=spec)
    hot = choose_hot_experts(
        spec.moe_layers, spec.num_experts, config.gpu_experts or 1,
        counts=worker_activation_counts(experts), placement_file=config.expert_placement,
    )  # fmt: skip
    log.info("GPU experts: %d per layer", len(next(iter(hot.values()))))
    return HybridExperts(experts, reader, hot, device, dtype)
