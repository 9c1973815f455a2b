"""Prefix caching through the whole two-process path: GPU service (this process) + a `ktserve
expert` subprocess. Hits give the tokens a service without prefix caching gives, and the cached
tokens never reach the expert worker."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_service.engine import FinishReason, SamplingParams
from gpu_service.experts.gpu_experts import worker_activation_counts
from tests.support.checkpoint_fixtures import one_per_family
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401 - autouse
from tests.support.worker_services import worker_service

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral")


CHECKPOINTS = one_per_family(FAMILIES)


def routed(service) -> int:
    """(token, expert) pairs the worker has computed so far."""
    return sum(worker_activation_counts(service.experts).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_hits_through_an_expert_worker_give_the_same_tokens_and_skip_its_calls(
    family, checkpoints, seed
):
    g = random.Random(seed)
    a = [g.randrange(101) for _ in range(40)]  # blocks of 16 (the service's)
    b = a[:37] + [g.randrange(101) for _ in range(5)]  # shares 37 tokens: 32 in full blocks
    worker = ExpertProcess("--model", str(checkpoints[family]), "--format", "bf16")
    runs = {}
    try:
        for caching in (True, False):
            service = worker_service(
                checkpoints[family], worker, device="cpu", dtype="float32", kv_cache_tokens=1024,
                prefix_caching=caching, kv_host_cache_gib=0.001 if caching else 0.0,
            )  # fmt: skip
            try:
                cache = service.engine.scheduler.kv_manager
                assert cache.prefix_caching == caching
                per_token = cache.config.bytes_per_token(torch.float32)
                host_blocks = int(0.001 * 2**30) // per_token // cache.block_size
                if caching:
                    assert cache.host is not None and cache.host.num_blocks == host_blocks
                else:
                    assert cache.host is None
                params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
                out = []
                for prompt in (a, a, b):
                    before = routed(service)
                    events = service.engine.generate(prompt, params)
                    assert events[-1].finish_reason == FinishReason.LENGTH, events[-1].error
                    tokens = [t.token_id for e in events for t in e.tokens]
                    out.append((tokens, events[-1].num_cached_tokens, routed(service) - before))
                runs[caching] = out
            finally:
                service.close()
    finally:
        worker.close()
    (cached, plain) = runs[True], runs[False]
    assert [t for t, _, _ in cached] == [t for t, _, _ in plain]
    assert [hit for _, hit, _ in cached] == [0, 32, 32]
    assert [hit for _, hit, _ in plain] == [0, 0, 0]
    # per request the worker computes k experts per MoE layer for each token fed: 40 + 5 without
    # a hit; 8 + 5 for the same prompt again; 10 + 5 for the one sharing 32 cached tokens
    per_token = plain[0][2] // 45
    assert [r for _, _, r in plain] == [45 * per_token, 45 * per_token, 47 * per_token]
    assert [r for _, _, r in cached] == [45 * per_token, 13 * per_token, 15 * per_token]
