"""The cost model's threshold against a brute-force search of its own two time formulas, and the
CPU side's fit against the experts a numpy simulation of uniform top-k routing touches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpu_service.experts.stream_prefill.cost_model import CpuCost, StreamCost, fit_cpu, linear_fit

LIMIT = 4_000


def brute_force_min_tokens(cost: StreamCost) -> int | None:
    """The least T such that every chunk in [T, max_tokens] streams faster; None if max_tokens
    does not."""
    first = None
    for t in range(cost.max_tokens, 0, -1):
        if not cost.streamed_s(t) < cost.cpu_s(t):
            break
        first = t
    return first


def random_cpu(rng: random.Random) -> CpuCost:
    e = rng.choice([8, 64, 128, 256])
    return CpuCost(e, rng.randint(1, min(8, e)),
                   fixed_s=rng.choice([0.0, rng.uniform(0, 0.02)]),
                   s_per_expert=rng.choice([0.0, rng.uniform(0, 1e-3)]),
                   s_per_token=rng.uniform(5e-6, 200e-6))  # fmt: skip


def test_min_tokens_is_the_first_chunk_from_which_on_streaming_is_faster(seed):
    rng = random.Random(seed)
    for _ in range(60):
        cost = StreamCost(
            layer_bytes=rng.randint(1 << 20, 1 << 30),
            h2d_bytes_per_s=rng.uniform(10e9, 60e9),
            gpu_fixed_s=rng.uniform(0, 0.05),
            gpu_s_per_token=rng.uniform(0, 20e-6),
            cpu=random_cpu(rng),
            max_tokens=LIMIT,
        )
        assert cost.min_tokens == brute_force_min_tokens(cost), cost
        assert "prefill: " in cost.describe()


def test_a_cpu_faster_per_token_never_streams():
    cost = StreamCost(1 << 30, 50e9, 0.0, 10e-6, CpuCost(128, 8, s_per_token=5e-6))
    assert cost.min_tokens is None
    assert "no chunk streams" in cost.describe()


def simulated_distinct(num_experts: int, k: int, num_tokens: int, rng) -> float:
    """Mean experts num_tokens tokens touch, each routed to k distinct experts at random."""
    counts = []
    for _ in range(200):
        picks = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :k]
        counts.append(len(np.unique(picks)))
    return float(np.mean(counts))


@pytest.mark.parametrize(("num_experts", "k"), [(128, 8), (64, 6), (8, 2)])
def test_distinct_experts_match_uniform_routing(num_experts, k, seed):
    rng = np.random.default_rng(seed)
    cpu = CpuCost(num_experts, k)
    for t in (1, 3, 16, 64):
        want = simulated_distinct(num_experts, k, t, rng)
        assert float(cpu.distinct(t)) == pytest.approx(want, rel=0.03, abs=0.2), t


def test_fit_recovers_the_terms_that_made_the_times(seed):
    rng = random.Random(seed)
    sizes = [1, 4, 16, 64, 256]
    for _ in range(20):
        made = random_cpu(rng)
        fitted = fit_cpu(made.num_experts, made.experts_per_token, sizes,
                         [float(made.seconds(t)) for t in sizes])  # fmt: skip
        for t in (1, 7, 100, 4096):
            assert fitted.seconds(t) == pytest.approx(made.seconds(t), rel=1e-6, abs=1e-9)


def test_fit_keeps_every_term_nonnegative(seed):
    rng = random.Random(seed)
    sizes = [1, 4, 16, 64, 256]
    for _ in range(50):
        seconds = [rng.uniform(1e-4, 0.05) for _ in sizes]  # noise, no law
        fitted = fit_cpu(128, 8, sizes, seconds)
        assert min(fitted.fixed_s, fitted.s_per_expert, fitted.s_per_token) >= 0


def test_short_chunks_stay_on_the_cpu_where_their_few_experts_are_cheap():
    """Qwen3-30B-A3B on the GPU host (as measured there): a call reads 2.65 MB per expert at
    ~90 GB/s; a layer's copy is 324 MiB at 54 GB/s. A 16-token chunk touches ~80 of 128
    experts (2.4 ms on the CPU, 6.2 ms streamed); 2,048 tokens touch all of them and their
    compute dominates."""
    cpu = CpuCost(128, 8, fixed_s=50e-6, s_per_expert=2.65e6 / 90e9, s_per_token=20e-6)
    cost = StreamCost(324 * 2**20, 54e9, 4.5e-3, 1e-6, cpu, max_tokens=8192)
    assert cost.cpu_s(16) < cost.streamed_s(16)
    assert 16 < cost.min_tokens < 2048
    # a line through two calibration sizes (the cost model before this one) overstates it
    fixed, per_token = linear_fit((64, 256), (cost.cpu_s(64), cost.cpu_s(256)))
    assert fixed + 16 * per_token > 1.3 * cost.cpu_s(16)


def test_linear_fit_recovers_a_line():
    fixed, per = linear_fit((10, 40), (0.5 + 10 * 0.01, 0.5 + 40 * 0.01))
    assert fixed == pytest.approx(0.5) and per == pytest.approx(0.01)
