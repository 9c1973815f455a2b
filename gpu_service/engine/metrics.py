"""The GPU service's Prometheus metrics (prefix ktserve_), on a registry of its own.

Where vLLM has the same concept the name after the prefix is vLLM's (vllm:num_requests_running
is ktserve_num_requests_running, ...); /metrics adds a model_name label to every sample
(ktserve/model_label.py). Requests: ktserve_num_requests_running / _waiting,
ktserve_request_success{finished_reason} (stop, length, abort, error),
ktserve_num_preemptions, ktserve_request_queue_time_seconds (arrival to first scheduled),
ktserve_time_to_first_token_seconds, ktserve_inter_token_latency_seconds,
ktserve_e2e_request_latency_seconds; ktserve_kv_cache_usage_perc (a fraction, as vLLM's).
Per finished request, as vLLM's: ktserve_request_prompt_tokens, ktserve_request_generation_tokens,
ktserve_request_params_max_tokens, and the phases of those that generated a token:
ktserve_request_prefill_time_seconds (first scheduled to first token),
ktserve_request_decode_time_seconds (first token to last) and
ktserve_request_inference_time_seconds (first scheduled to last token: the two together);
ktserve_request_params_n per HTTP request (its choices, each one engine request).
Prefix cache, named as vLLM names them: ktserve_prefix_cache_queries (prompt tokens looked up at
admission) and ktserve_prefix_cache_hits (tokens found; label tier: gpu for the device KV cache,
cpu for the host-RAM tier), and ktserve_{gpu,cpu}_prefix_cache_hit_rate, each tier's hits over
all queried tokens since the start (the two add up to the overall hit rate).
Mixed steps (gpu_service/engine/step_cost.py, chunk_policy.py): ktserve_step_cost_model_seconds
{way, term} (the fitted step-time models, way cpu for steps through the CPU workers and streamed
for steps that streamed their prefill rows' experts: fixed, per_token, per_attention_pair), and of
the last step whose prompt chunks were sized beside decode rows,
ktserve_mixed_step_decode_seconds (the predicted time of its decode rows alone) and
ktserve_mixed_step_prompt_tokens (the prompt tokens it carried).
Memory (set once at start-up from the plan, gpu_service/memory_plan.py):
ktserve_gpu_memory_plan_bytes{part} (weights, activations, cuda_graphs, non_torch, other, headroom,
kv_cache; parts not measured on the device are absent) and ktserve_kv_cache_capacity_tokens.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpu_service.kvcache.manager import PrefixCacheStats

if TYPE_CHECKING:
    from gpu_service.engine.chunk_policy import StepCostModels
    from gpu_service.engine.request import Request
    from gpu_service.engine.scheduler import ScheduledStep
    from gpu_service.memory_plan import MemoryPlan

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FAST = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3,
        51.2e-3, 0.1, 0.2, 0.4, 0.8, 1.6)  # fmt: skip
DEFAULT_MAX_MODEL_LEN = 8192
PARAMS_N = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:  # fmt: skip
        """max_model_len: the token-count histograms' largest bucket is below it (then +Inf)."""
        self.registry = registry or CollectorRegistry()
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)

        def histogram(name: str, doc: str, buckets=LATENCY, labels=()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        tokens = buckets_1_2_5(max_model_len)
        # requests
        self.ttft = histogram(
            "ktserve_time_to_first_token_seconds", "Arrival to first generated token"
        )
        self.itl = histogram(
            "ktserve_inter_token_latency_seconds", "Time between consecutive tokens of a request"
        )
        self.e2e = histogram("ktserve_e2e_request_latency_seconds", "Arrival to finish")
        self.prompt_tokens = counter("ktserve_prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("ktserve_generation_tokens", "Tokens generated")
        self.finished = counter(
            "ktserve_request_success", "Finished requests by reason", ["finished_reason"]
        )
        self.running = gauge("ktserve_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("ktserve_num_requests_waiting", "Requests queued")
        self.kv_usage = gauge(
            "ktserve_kv_cache_usage_perc",
            "KV-cache usage: the fraction of KV blocks in use (1 = full)",
        )
        self.preemptions = counter(
            "ktserve_num_preemptions", "Requests preempted (KV cache full), to be recomputed"
        )
        self.queue_time = histogram(
            "ktserve_request_queue_time_seconds",
            "Arrival to first scheduled (time in the waiting queue)",
        )
        self.prefill_time = histogram(
            "ktserve_request_prefill_time_seconds",
            "First scheduled to first token (the prefill phase)",
        )
        self.decode_time = histogram(
            "ktserve_request_decode_time_seconds", "First token to last token (the decode phase)"
        )
        self.inference_time = histogram(
            "ktserve_request_inference_time_seconds",
            "First scheduled to last token (prefill and decode)",
        )
        self.request_prompt_tokens = histogram(
            "ktserve_request_prompt_tokens", "Prompt tokens per finished request", tokens
        )
        self.request_generation_tokens = histogram(
            "ktserve_request_generation_tokens", "Tokens generated per finished request", tokens
        )
        self.request_max_tokens = histogram(
            "ktserve_request_params_max_tokens", "The max_tokens of each finished request", tokens
        )
        self.request_n = histogram(
            "ktserve_request_params_n", "The n (choices) of each HTTP request", PARAMS_N
        )
        # steps
        self.step_seconds = histogram(
            "ktserve_step_seconds",
            "Per-step time by phase: gpu (compute on the GPU), transfer (hidden states to and "
            "from the expert channels), expert_wait (waiting for the CPU experts)",
            FAST,
            ["phase"],
        )
        self.host_seconds = histogram(
            "ktserve_engine_host_seconds",
            "The engine thread's own work per step, outside the forward: between (from one "
            "step's results to the next step's start, where that step left requests running "
            "or waiting: output processing, new requests, scheduling), sample (logits to token "
            "ids, the device sync included), launch (a started decode step's graph launched: the "
            "host's call), replay (of launch, the CUDA graph's replay() call alone); for a "
            "step chained to the last one, between is from the last one's device work ending "
            "to this one's launch",
            FAST,
            ["part"],
        )
        self.chained_steps = counter(
            "ktserve_chained_steps",
            "Decode steps chained to the step before them: launched as soon as its device work "
            "ended, their tokens its samples on the device (KTSERVE_CHAIN_DECODE_STEPS=0: none)",
        )
        self.step_tokens = counter("ktserve_step_tokens", "Tokens run through the model")
        self.steps = counter(
            "ktserve_steps",
            "Forward steps by mode: graph (decode replayed as CUDA graphs) or eager",
            ["mode"],
        )
        self.prefill_streamed_tokens = counter(
            "ktserve_prefill_streamed_tokens",
            "Prefill tokens whose routed experts ran on the GPU from streamed weights "
            "(--stream-prefill)",
        )
        self.moe_round_trip = histogram(
            "ktserve_moe_round_trip_seconds",
            "One MoE call: submit to the expert workers until their summed reply",
            FAST,
        )
        # prefix cache
        self.prefix_cache_queries = counter(
            "ktserve_prefix_cache_queries",
            "Prefix cache queries: tokens looked up in the prefix cache at admission",
        )
        self.prefix_cache_hits = counter(
            "ktserve_prefix_cache_hits",
            "Prefix cache hits: tokens found in the prefix cache, by tier (gpu: the device KV "
            "cache, cpu: the host-RAM tier)",
            ["tier"],
        )
        self.prefix_cache_hit_rate = {
            tier: gauge(
                f"ktserve_{tier}_prefix_cache_hit_rate",
                f"Tokens found in the {where} over tokens looked up, since the start",
            )
            for tier, where in (("gpu", "device KV cache"), ("cpu", "host-RAM tier"))
        }
        self._prefix_seen = PrefixCacheStats()
        # memory, mixed steps
        self.memory_plan_bytes = gauge(
            "ktserve_gpu_memory_plan_bytes",
            "The start-up GPU memory plan: bytes per part of --gpu-memory-utilization's budget",
            ["part"],
        )
        self.kv_cache_capacity = gauge(
            "ktserve_kv_cache_capacity_tokens", "Tokens the KV cache holds"
        )
        self.step_cost_model = gauge(
            "ktserve_step_cost_model_seconds",
            "The step-time models fitted from measured steps, per way (cpu: through the CPU "
            "workers; streamed: prefill experts streamed to the GPU) and term: fixed (per step), "
            "per_token, per_attention_pair",
            ["way", "term"],
        )
        self.mixed_step_decode_seconds = gauge(
            "ktserve_mixed_step_decode_seconds",
            "The predicted time of the decode rows alone in the last step whose prompt chunks "
            "were sized beside them",
        )
        self.mixed_step_prompt_tokens = gauge(
            "ktserve_mixed_step_prompt_tokens",
            "Prompt tokens of the last step whose chunks were sized beside decode rows",
        )

    def observe_memory_plan(self, plan: MemoryPlan) -> None:
        for part, value in plan.parts.items():
            if value is not None:
                self.memory_plan_bytes.labels(part=part).set(value)
        self.kv_cache_capacity.set(plan.kv_cache_tokens)

    def observe_prefix_cache(self, stats: PrefixCacheStats) -> None:
        """Bring the prefix-cache metrics up to the cache's running totals."""
        seen = self._prefix_seen
        self.prefix_cache_queries.inc(stats.queries - seen.queries)
        self.prefix_cache_hits.labels(tier="gpu").inc(stats.device_hits - seen.device_hits)
        self.prefix_cache_hits.labels(tier="cpu").inc(stats.host_hits - seen.host_hits)
        if stats.queries:
            self.prefix_cache_hit_rate["gpu"].set(stats.device_hits / stats.queries)
            self.prefix_cache_hit_rate["cpu"].set(stats.host_hits / stats.queries)
        self._prefix_seen = PrefixCacheStats(stats.queries, stats.device_hits, stats.host_hits)

    def observe_finished(self, request: Request, last_token_time: float) -> None:
        """The per-request histograms of a request that just finished (any reason); the phases
        only if it was scheduled and generated a token (last_token_time: its last one's)."""
        self.request_prompt_tokens.observe(len(request.prompt_ids))
        self.request_generation_tokens.observe(len(request.output))
        self.request_max_tokens.observe(request.params.max_tokens)
        scheduled, first = request.first_scheduled_time, request.first_token_time
        if scheduled is None or first is None:
            return
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last_token_time - first)
        self.inference_time.observe(last_token_time - scheduled)

    def observe_step(self, total: float, transfer: float, wait: float, num_tokens: int,
                     graphed: bool = False) -> None:  # fmt: skip
        self.steps.labels(mode="graph" if graphed else "eager").inc()
        self.step_seconds.labels(phase="gpu").observe(max(total - transfer - wait, 0.0))
        self.step_seconds.labels(phase="transfer").observe(transfer)
        self.step_seconds.labels(phase="expert_wait").observe(wait)
        self.step_tokens.inc(num_tokens)

    def observe_step_cost(self, models: StepCostModels, step: ScheduledStep) -> None:
        for way, model in (("cpu", models.cpu), ("streamed", models.streamed)):
            fit = model.last_fit
            if fit is not None:
                gauge = self.step_cost_model
                gauge.labels(way=way, term="fixed").set(fit.fixed_s)
                gauge.labels(way=way, term="per_token").set(fit.per_token_s)
                gauge.labels(way=way, term="per_attention_pair").set(fit.per_pair_s)
        if step.decode_s is not None:
            self.mixed_step_decode_seconds.set(step.decode_s)
            prompt = sum(len(s.token_ids) for s in step.seqs if len(s.token_ids) > 1)
            self.mixed_step_prompt_tokens.set(prompt)
