"""The cost model's threshold against a brute-force search of its own two time formulas."""

from __future__ import annotations

import random

import pytest

from gpu_service.stream_prefill.cost_model import StreamCost, linear_fit

LIMIT = 20_000


def brute_force_min_tokens(cost: StreamCost, limit: int = LIMIT) -> int | None:
    """The least T such that every chunk in [T, limit) streams faster; None if limit - 1
    does not."""
    first = limit
    for t in range(limit - 1, 0, -1):
        if not cost.streamed_s(t) < cost.cpu_s(t):
            break
        first = t
    return None if first == limit else first


def test_min_tokens_is_the_first_chunk_that_streams_faster(seed):
    rng = random.Random(seed)
    for _ in range(100):
        cost = StreamCost(
            layer_bytes=rng.randint(1 << 20, 1 << 30),
            h2d_bytes_per_s=rng.uniform(10e9, 60e9),
            gpu_fixed_s=rng.uniform(0, 0.05),
            gpu_s_per_token=rng.uniform(0, 20e-6),
            cpu_s_per_token=rng.uniform(5e-6, 200e-6),
            cpu_fixed_s=rng.choice([0.0, rng.uniform(0, 0.02)]),
        )
        want = brute_force_min_tokens(cost)
        got = cost.min_tokens
        if want is None:  # not within the search: the formula's answer lies beyond it
            assert got is None or got >= LIMIT
        else:
            assert got == want, cost
        assert "prefill: " in cost.describe()


def test_a_cpu_faster_per_token_never_streams():
    cost = StreamCost(1 << 30, 50e9, 0.0, 10e-6, 5e-6)
    assert cost.min_tokens is None
    assert "no chunk streams" in cost.describe()


def test_linear_fit_recovers_a_line():
    fixed, per = linear_fit((10, 40), (0.5 + 10 * 0.01, 0.5 + 40 * 0.01))
    assert fixed == pytest.approx(0.5) and per == pytest.approx(0.01)
