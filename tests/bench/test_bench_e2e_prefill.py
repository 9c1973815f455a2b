"""bench_e2e's prefill measurement on a real two-process service (GPU service in this process, a
`ktserve expert` subprocess): its prompts share no start, so the prefix cache serves none of
their tokens, and a prompt it did serve in part stops the run instead of being timed."""

from __future__ import annotations

import pytest

from bench.bench_e2e import prefill
from tests.support.expert_procs import no_segments_left_behind  # noqa: F401 - autouse
from tests.support.worker_services import tiny_served


def prefix_cache_hits(service) -> float:
    """Prompt tokens the service's prefix cache has served so far, both tiers (its counter)."""
    return sum(sample.value for metric in service.metrics.prefix_cache_hits.collect()
               for sample in metric.samples if sample.name.endswith("_total"))  # fmt: skip


def test_prefill_prompts_miss_the_prefix_cache_and_a_hit_stops_the_run(tmp_path, seed):
    with tiny_served(tmp_path, seed, max_model_len=256, kv_cache_tokens=2048) as service:
        assert service.engine.scheduler.kv_manager.prefix_caching
        # the lengths bench_e2e times, scaled down: each longer one, for each repeat, once
        # began with the shorter ones (blocks of 16 tokens: 48 of 64 could have hit)
        for n in (48, 64, 128):
            for rep in (1, 2):
                assert prefill(service, n, rep) > 0
        assert prefix_cache_hits(service) == 0
        with pytest.raises(SystemExit, match="served in part by the prefix cache"):
            prefill(service, 64, 1)  # the same prompt again
        assert prefix_cache_hits(service) > 0
