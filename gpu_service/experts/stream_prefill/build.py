"""Start-up of prefill streaming (--stream-prefill): map the workers' packed stores, allocate
the two staging layers, measure the cost model on this machine and print the choice."""

from __future__ import annotations

import logging

import torch

from gpu_service.experts.errors import ExpertsUnavailable
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.experts.routed import RoutedExperts
from gpu_service.experts.stream_prefill.backend import StreamingExperts
from gpu_service.experts.stream_prefill.compute import scratch_bound, streamed_moe
from gpu_service.experts.stream_prefill.cost_model import StreamCost, fit_cpu, linear_fit, timed
from gpu_service.experts.stream_prefill.staging import LayerStager
from gpu_service.experts.stream_prefill.store import MappedStore, UntrustedStore
from ktserve.checkpoint import ModelSpec

log = logging.getLogger("ktserve.gpu")

CALIBRATION_TOKENS = 256
# NOTE: the staging slots are allocated before the model loads (the memory plan must see them):
# auto builds them only where they take at most this share of the free memory, leaving the model
# room to load; whether the KV cache left holds the context decides after the plan
# (kv_room_declines); --stream-prefill on streams whatever they take
AUTO_MAX_FREE_FRACTION = 0.5
# NOTE: the CPU workers' calibration calls: a few tokens read a few experts, 256 nearly all
CPU_CALIBRATION_SIZES = (1, 4, 16, 64, 256)


class StreamPrefillUnavailable(RuntimeError):
    """--stream-prefill on, and the workers' experts cannot be streamed (the reason says why)."""


def build_streaming(
    mode: str, spec: ModelSpec, workers: ShmExperts, backend: RoutedExperts,
    device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1,
) -> StreamingExperts | None:  # fmt: skip
    """The backend with prefill streaming over `backend` (None: mode off, or auto and
    streaming is not possible or not worth it here, logged). `on` with tensor parallelism is
    refused by the config already."""
    if mode == "off":
        return None
    if mode == "auto" and tensor_parallel_size > 1:
        log.info("prefill: experts stay on the CPU workers (streaming them to the GPU is not "
                 "supported with --tensor-parallel-size > 1 yet)")  # fmt: skip
        return None
    if mode == "auto" and device.type != "cuda":
        log.info("prefill: experts stay on the CPU workers (--stream-prefill auto streams only "
                 "to a CUDA device; the model runs on %s)", device)  # fmt: skip
        return None
    stores: list[MappedStore] = []
    try:
        for w in workers.workers:
            stores.append(MappedStore(w.info, spec.hidden_size, spec.moe_intermediate_size,
                                      spec.moe_layers))  # fmt: skip
        if mode == "auto":
            check_auto_memory(streaming_bytes(stores, spec, dtype),
                              torch.cuda.mem_get_info(device)[0])  # fmt: skip
        stager = LayerStager(stores, spec.num_experts, device)
    except (UntrustedStore, ValueError, OSError) as exc:
        for store in stores:
            store.close()
        if mode == "on":
            raise StreamPrefillUnavailable(f"--stream-prefill on: {exc}") from exc
        log.warning("prefill: experts stay on the CPU workers: %s", exc)
        return None
    streaming = StreamingExperts(backend, stager, spec.hidden_size, spec.moe_intermediate_size,
                                 spec.moe_layers, dtype, min_tokens=1)  # fmt: skip
    streaming.follow(workers)
    try:
        cost = measure(streaming, workers, spec, max_tokens=workers.max_tokens)
    except ExpertsUnavailable:  # NOTE: the workers' failure, not streaming's
        streaming.close()
        raise
    except RuntimeError as exc:  # NOTE: torch.OutOfMemoryError is one
        streaming.close()
        if mode == "on":
            raise StreamPrefillUnavailable(f"--stream-prefill on: measuring failed: {exc}") from exc
        log.warning("prefill: experts stay on the CPU workers (measuring streaming failed: %s)",
                    exc)  # fmt: skip
        return None
    except BaseException:
        streaming.close()
        raise
    streaming.cost = cost
    if mode == "on":
        log.info("prefill: --stream-prefill on: every chunk streams experts to the GPU (the cost "
                 "model: %s)", cost.describe().removeprefix("prefill: "))  # fmt: skip
    else:
        streaming.min_tokens = cost.min_tokens
        log.info("%s", cost.describe())
    log.info("prefill streaming holds %.2f GiB of %s memory (two MoE layers' packed experts "
             "%.2f GiB, dequantization scratch %.2f GiB; pinned host mappings: %s)",
             streaming.memory_bytes / 2**30, device.type, stager.memory_bytes / 2**30,
             streaming.scratch_bound / 2**30, "yes" if stager.pinned else "no")  # fmt: skip
    if mode == "auto" and cost.min_tokens is None:
        streaming.close()
        return None
    return streaming


def streaming_bytes(stores: list[MappedStore], spec: ModelSpec, dtype: torch.dtype) -> int:
    """Device memory streaming from these stores would hold: two MoE layers' packed experts and
    the dequantization scratch (StreamingExperts.memory_bytes, known before allocating it)."""
    return LayerStager.bytes_for(stores) + scratch_bound(
        spec.hidden_size, spec.moe_intermediate_size, dtype, spec.num_experts
    )


def check_auto_memory(need: int, free: int) -> None:
    """ValueError where streaming's `need` bytes exceed auto's share of the GPU's `free` memory
    before the model loads."""
    if need > AUTO_MAX_FREE_FRACTION * free:
        raise ValueError(
            f"streaming would hold {need / 2**30:.2f} GiB of the GPU's {free / 2**30:.1f} GiB free "
            f"before the model loads (two MoE layers' experts and the dequantization scratch; "
            f"auto takes at most {AUTO_MAX_FREE_FRACTION:.0%}, --stream-prefill on takes it "
            f"anyway)"
        )


def kv_room_declines(kv_room_tokens: int, required_tokens: int, required_by: str,
                     streaming_bytes: int) -> str | None:  # fmt: skip
    """Why auto gives streaming up after the memory plan (None: it keeps it): the KV cache the
    plan leaves beside streaming holds fewer tokens than the configuration needs (required_by:
    what asks for them, --kv-cache-tokens or one full context)."""
    if kv_room_tokens >= required_tokens:
        return None
    return (
        f"streaming's {streaming_bytes / 2**30:.2f} GiB would leave the KV cache "
        f"{kv_room_tokens} tokens, fewer than {required_by} ({required_tokens}); "
        "--stream-prefill on streams anyway"
    )


def measure(streaming: StreamingExperts, workers: ShmExperts, spec: ModelSpec,
            max_tokens: int) -> StreamCost:  # fmt: skip
    """The cost model's rates on this machine: one layer's copy, its compute at two sizes, and
    calibration calls of the same tokens to the CPU workers at CPU_CALIBRATION_SIZES."""
    stager, device = streaming.stager, streaming.stager.device
    layer = spec.moe_layers[0]
    small = max(1, min(CALIBRATION_TOKENS, max_tokens) // 4)
    large = max(small + 1, min(CALIBRATION_TOKENS, max_tokens))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(large, spec.hidden_size, generator=g) * 0.1).to(device, streaming.dtype)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.num_experts_per_tok]
                       for _ in range(large)]).to(device, torch.int32)  # fmt: skip
    weights = torch.full(ids.shape, 1.0 / ids.shape[1], device=device)

    def copy() -> None:
        stager.reset()
        stager.acquire(layer)

    copy_s = timed(copy, device)

    def compute(n: int):
        packed = stager.acquire(layer)
        return lambda: streamed_moe(stager.fmt, packed, spec.hidden_size,
                                    spec.moe_intermediate_size, x[:n], ids[:n], weights[:n],
                                    streaming.dtype, streaming.scratch_bytes)  # fmt: skip

    fixed, per_token = linear_fit((small, large), (timed(compute(small), device),
                                                   timed(compute(large), device)))  # fmt: skip

    def on_cpu(n: int):
        return lambda: workers.submit(layer, x[:n], ids[:n], weights[:n]).wait()

    sizes = sorted({min(n, large) for n in CPU_CALIBRATION_SIZES})
    cpu = fit_cpu(spec.num_experts, spec.num_experts_per_tok, sizes,
                  [timed(on_cpu(n), device) for n in sizes])  # fmt: skip
    return StreamCost(stager.layer_nbytes, stager.layer_nbytes / copy_s, fixed, per_token, cpu,
                      max_tokens=max_tokens)  # fmt: skip
