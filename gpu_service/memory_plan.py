"""The start-up GPU memory plan: how --gpu-memory-utilization of the GPU's total memory is split.

    budget = utilization * total
           = weights + activations + cuda_graphs + non_torch + other + headroom + kv_cache
weights: the model's buffers (after quantization). activations: the peak above the weights of a
profiling forward of max_num_batched_tokens tokens, in sequences of at most max_model_len (and
at most max_num_seqs of them), as vLLM's profile run; its MoE layers call the expert workers
like any step. cuda_graphs: a reserve for the decode graphs'
memory pool, the peak of an eager decode step at the largest graph batch (at least
MIN_GRAPH_RESERVE). non_torch: memory in use on the device outside torch's allocator (the CUDA
context, libraries' workspaces, other processes). other: torch's allocations of this process
beside the model's (a caller's tensors; an earlier service in the same process, once garbage,
is collected first). headroom: HEADROOM_FRACTION of the budget (at
least MIN_HEADROOM) against fragmentation. The KV cache takes the rest, in whole tokens.
On the CPU nothing is measured: the plan holds the weights and the KV cache only.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import torch

from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.models import Batch, KVCacheTensors, SeqInput
from gpu_service.models.model import CausalLM

GIB = 2**30
HEADROOM_FRACTION = 0.02
MIN_HEADROOM = 256 * 2**20
MIN_GRAPH_RESERVE = 256 * 2**20
MIN_KV_TOKENS = 16
PARTS = (
    "weights",
    "activations",
    "cuda_graphs",
    "non_torch",
    "other",
    "prefill_streaming",
    "headroom",
    "kv_cache",
)


class GPUMemoryTooSmall(RuntimeError):
    """The budget leaves no room for a KV cache."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part (None: not measured on this device) and the KV cache's capacity."""

    device: str
    total: int | None
    budget: int | None
    parts: dict[str, int | None]
    kv_cache_tokens: int

    def table(self) -> str:
        budget = self.budget
        lines = [f"GPU memory plan on {self.device}"
                 + (f": budget {budget / GIB:.2f} of {self.total / GIB:.2f} GiB"
                    if budget and self.total else " (nothing measured off CUDA)")]  # fmt: skip
        lines.append(f"  {'part':<12} {'GiB':>8} {'MiB':>10} {'share':>7}")
        for part in PARTS:
            value = self.parts.get(part)
            if value is None:
                lines.append(f"  {part:<12} {'n/a':>8}")
                continue
            share = f"{value / budget:7.1%}" if budget else ""
            lines.append(f"  {part:<12} {value / GIB:8.3f} {value / 2**20:10.1f} {share}")
        lines.append(f"  KV cache capacity: {self.kv_cache_tokens} tokens")
        return "\n".join(lines)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's buffers and parameters, each storage counted once."""
    seen: dict[int, int] = {}
    for tensor in (*model.buffers(), *model.parameters()):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cpu_plan(model: CausalLM, kv_tokens: int, dtype: torch.dtype) -> MemoryPlan:
    per_token = model.kv_cache.config.bytes_per_token(dtype)
    parts = {"weights": weight_bytes(model), "kv_cache": kv_tokens * per_token}
    return MemoryPlan(str(model.device), None, None, parts, kv_tokens)


def cuda_plan(
    model: CausalLM,
    dtype: torch.dtype,
    utilization: float,
    max_num_batched_tokens: int,
    max_graph_batch: int,
    kv_tokens: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 1,
    streaming_bytes: int = 0,
) -> MemoryPlan:
    """The plan on the model's CUDA device, after the profiling forwards; kv_tokens given
    (--kv-cache-tokens): that cache, the headroom being what is left. streaming_bytes: the
    prefill streaming's staging slots (--stream-prefill), allocated already."""
    device = model.device
    lengths = profile_lengths(max_num_batched_tokens, max_model_len, max_num_seqs)
    activations = profile_peak(model, lengths)
    graphs = max(profile_peak(model, [1] * max_graph_batch), MIN_GRAPH_RESERVE)
    gc.collect()  # NOTE: an earlier service's tensors, unreachable but in cycles, go first
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    weights = weight_bytes(model)
    other = max(torch.cuda.memory_allocated(device) - weights - streaming_bytes, 0)
    per_token = model.kv_cache.config.bytes_per_token(dtype)
    fixed = weights + activations + graphs + non_torch + other + streaming_bytes
    if kv_tokens is None:
        headroom = max(int(HEADROOM_FRACTION * budget), MIN_HEADROOM)
        kv_tokens = (budget - fixed - headroom) // per_token
        if kv_tokens < MIN_KV_TOKENS:
            raise GPUMemoryTooSmall(
                f"--gpu-memory-utilization {utilization} of {total / GIB:.2f} GiB leaves "
                f"{(budget - fixed - headroom) / GIB:.2f} GiB for the KV cache after weights "
                f"{weights / GIB:.2f}, activations {activations / GIB:.2f}, CUDA graphs "
                f"{graphs / GIB:.2f}, prefill streaming {streaming_bytes / GIB:.2f}, outside "
                f"torch {non_torch / GIB:.2f}, this process's other tensors {other / GIB:.2f} "
                f"and headroom "
                f"{headroom / GIB:.2f} GiB: raise --gpu-memory-utilization, lower "
                "--max-num-batched-tokens, or use --gpu-weight-format fp8 or int4"
            )
    kv_bytes = kv_tokens * per_token
    parts = {"weights": weights, "activations": activations, "cuda_graphs": graphs,
             "non_torch": non_torch, "other": other, "prefill_streaming": streaming_bytes,
             "headroom": budget - fixed - kv_bytes, "kv_cache": kv_bytes}  # fmt: skip
    return MemoryPlan(str(device), total, budget, parts, kv_tokens)


def profile_lengths(num_tokens: int, max_model_len: int | None, max_num_seqs: int) -> list[int]:
    """num_tokens as the scheduler could fill a step: sequences of at most max_model_len, at
    most max_num_seqs of them."""
    longest = max_model_len or num_tokens
    lengths: list[int] = []
    while num_tokens > 0 and len(lengths) < max(max_num_seqs, 1):
        lengths.append(min(num_tokens, longest))
        num_tokens -= lengths[-1]
    return lengths


def profile_peak(model: CausalLM, lengths: list[int]) -> int:
    """Peak bytes above what is allocated now of one forward of sequences of these prompt
    lengths (a KV cache just large enough for them is made for it, and not counted)."""
    device, cache = model.device, model.kv_cache
    block = cache.config.block_size
    tokens = sum(-(-n // block) * block for n in lengths)
    profile_config = replace(cache.config, max_num_tokens=tokens, enable_prefix_caching=False,
                             max_num_host_tokens=0)  # fmt: skip
    profile_cache = KVCacheTensors(profile_config, model.dtype, device)
    profile_blocks = KVCacheManager(profile_config)
    vocab = model.config.vocab_size
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.kv_cache = profile_cache
    try:
        seqs = tuple(
            SeqInput([(i * 7919) % vocab for i in range(n)], profile_blocks.allocate(n), 0)
            for n in lengths
        )
        model.forward(Batch(seqs))
        torch.cuda.synchronize(device)
    finally:
        model.kv_cache = cache
    return max(torch.cuda.max_memory_allocated(device) - base, 0)
