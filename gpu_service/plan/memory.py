"""The plan's numbers: the parts memory_plan.py measures at start-up, predicted from the config
(weights, KV cache and streaming buffers exactly; activations, CUDA graphs and memory outside
torch as estimates), the host RAM the expert workers hold, and whether it all fits.

    budget = utilization x GPU memory
           = weights + activations + cuda_graphs + non_torch + prefill_streaming + headroom
             + kv_cache (the context asked)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_service.experts.stream_prefill.compute import scratch_bound
from gpu_service.experts.stream_prefill.staging import NUM_SLOTS
from gpu_service.memory_plan import HEADROOM_FRACTION, MIN_GRAPH_RESERVE, MIN_HEADROOM
from gpu_service.plan.gpu_tensors import gpu_tensors
from gpu_service.plan.sizes import (
    expert_bytes,
    gpu_weight_bytes,
    kv_cache_config,
    worker_expert_counts,
)
from ktserve.checkpoint import HFConfig, ModelSpec

# NOTE: estimates, not measurements: the CUDA context and libraries' workspaces outside torch
# (about 0.5-1 GiB on an H100), and a profiling forward's peak per batched token (hidden states,
# the MLP's intermediates, logits of the last tokens).
NON_TORCH_ESTIMATE = 768 * 2**20
GPU_PARTS = ("weights", "activations", "cuda_graphs", "non_torch", "prefill_streaming",
             "headroom", "kv_cache")  # fmt: skip
ESTIMATED_PARTS = ("activations", "cuda_graphs", "non_torch")


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is asked: serve's flags and the machine (None: not known)."""

    expert_format: str = "int8"
    gpu_weight_format: str = "bf16"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    expert_workers: int = 1
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    stream_prefill: bool = True
    gpu_memory: int | None = None
    ram: int | None = None
    node_memory: tuple[int, ...] = ()  # per NUMA node, where several: a worker on each
    model_dtype: str = "bfloat16"  # serve's on CUDA; float32 is the CPU's

    def __post_init__(self) -> None:
        if self.expert_workers < 1:
            raise ValueError(f"--expert-workers must be >= 1, got {self.expert_workers}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.model_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"model dtype must be bfloat16, float16 or float32: {self.model_dtype}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.model_dtype)


@dataclass(frozen=True)
class MemoryEstimate:
    """GPU bytes per part (GPU_PARTS), host bytes per worker, and what fits."""

    gpu_parts: dict[str, int]
    gpu_budget: int | None
    kv_bytes_per_token: int
    context: int  # the context asked: --max-model-len or the model's own
    largest_context: int | None  # the most tokens the budget leaves the KV cache (None: no GPU)
    expert_bytes: int  # one routed expert, packed
    worker_expert_bytes: tuple[int, ...]  # per worker
    ram: int | None
    node_memory: tuple[int, ...]

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu_parts.values())

    @property
    def host_total(self) -> int:
        return sum(self.worker_expert_bytes)

    @property
    def gpu_fits(self) -> bool | None:
        return None if self.gpu_budget is None else self.gpu_total <= self.gpu_budget

    @property
    def host_fits(self) -> bool | None:
        return None if self.ram is None else self.host_total <= self.ram

    @property
    def nodes_fit(self) -> bool | None:
        """Each worker within its node's memory, where serve's --numa auto puts one worker on
        each of several nodes (None: one node, or workers not one a node)."""
        per_worker, nodes = self.worker_expert_bytes, self.node_memory
        if len(nodes) < 2 or len(per_worker) != len(nodes):
            return None
        return all(held <= node for held, node in zip(per_worker, nodes, strict=True))


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "fp8":
        return torch.float8_e4m3fn
    if name != "auto":
        raise ValueError(f"--kv-cache-dtype must be auto or fp8, got {name!r}")
    return model_dtype


def activation_estimate(hf: HFConfig, spec: ModelSpec, inputs: PlanInputs) -> int:
    """A profiling forward's peak: per batched token the residual and attention's outputs (4 x
    hidden), the largest MLP's gate/up/act (3 x its intermediate), the routed experts' outputs
    (top-k x hidden), in the model dtype; float32 logits of the last token of each sequence."""
    hidden = spec.hidden_size
    inter = max(hf.int("intermediate_size", spec.moe_intermediate_size), spec.moe_intermediate_size)
    per_token = (4 + spec.num_experts_per_tok) * hidden + 3 * inter
    tokens = inputs.max_num_batched_tokens
    seqs = min(inputs.max_num_seqs, tokens)
    return tokens * per_token * inputs.dtype.itemsize + seqs * hf.int("vocab_size") * 4


def streaming_bytes(spec: ModelSpec, inputs: PlanInputs) -> int:
    """--stream-prefill's device buffers: NUM_SLOTS MoE layers' packed experts and the
    dequantization scratch (build.py streaming_bytes, before any store is mapped)."""
    if not inputs.stream_prefill:
        return 0
    layer = spec.num_experts * expert_bytes(spec, inputs.expert_format)
    return NUM_SLOTS * layer + scratch_bound(
        spec.hidden_size, spec.moe_intermediate_size, inputs.dtype, spec.num_experts
    )


def estimate_memory(hf: HFConfig, inputs: PlanInputs, model_max_len: int) -> MemoryEstimate:
    spec = ModelSpec.from_hf(hf)
    weights = gpu_weight_bytes(gpu_tensors(hf), inputs.gpu_weight_format, inputs.dtype)
    cache_dtype = kv_dtype(inputs.kv_cache_dtype, inputs.dtype)
    per_token = kv_cache_config(hf).bytes_per_token(cache_dtype)
    context = inputs.max_model_len or model_max_len
    budget = None
    if inputs.gpu_memory is not None:
        budget = int(inputs.gpu_memory_utilization * inputs.gpu_memory)
    headroom = max(int(HEADROOM_FRACTION * budget), MIN_HEADROOM) if budget else MIN_HEADROOM
    parts = {"weights": weights, "activations": activation_estimate(hf, spec, inputs),
             "cuda_graphs": MIN_GRAPH_RESERVE, "non_torch": NON_TORCH_ESTIMATE,
             "prefill_streaming": streaming_bytes(spec, inputs), "headroom": headroom,
             "kv_cache": context * per_token}  # fmt: skip
    largest = None
    if budget is not None:
        room = budget - (sum(parts.values()) - parts["kv_cache"])
        largest = max(min(room // per_token, model_max_len), 0)
    one_expert = expert_bytes(spec, inputs.expert_format)
    counts = worker_expert_counts(spec.num_experts, inputs.expert_workers)
    per_worker = tuple(n * one_expert * spec.num_moe_layers for n in counts)
    return MemoryEstimate(parts, budget, per_token, context, largest, one_expert, per_worker,
                          inputs.ram, inputs.node_memory)  # fmt: skip
