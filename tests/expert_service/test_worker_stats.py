"""A worker's counts (GetStats, /metrics) against the calls two channels sent it at once."""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections import Counter

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import ktshm
from expert_service.metrics import CallCounts
from expert_service.worker import IDLE_GAP_S, count_idle_gap
from ktserve.checkpoint import ModelSpec
from ktserve.protocol import expert_pb2 as pb
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.expert_procs import (  # noqa: F401 - no_segments_left_behind is an autouse fixture
    ExpertProcess,
    moe_call,
    no_segments_left_behind,
)

CHECKPOINT = TinyCheckpoint("qwen3_moe")

CALLS_PER_CHANNEL = 40


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{rest}}}"] = s.value
    return samples


def test_idle_gaps_inside_a_step_are_told_from_those_across_its_end():
    # (layer, gap before it): a step over MoE layers 1, 2, 3 where layer 2 also has a deferred
    # call, the next step's first layer, then a gap too long to be a layer's (another request)
    calls = [(1, 0.0030), (2, 0.0010), (2, 0.0001), (3, 0.0020), (1, 0.0040), (2, 0.0007),
             (3, IDLE_GAP_S + 1e-4)]  # fmt: skip
    counts, answered = CallCounts(), -1
    for layer, gap in calls:
        count_idle_gap(counts, answered, layer, gap)
        answered = layer
    # the first call follows none: idle, not inner
    assert counts.idle_gaps == 6
    assert counts.idle_seconds == pytest.approx(0.0030 + 0.0010 + 0.0001 + 0.0020 + 0.0040 + 0.0007)
    assert counts.inner_idle_gaps == 3  # 1 -> 2, (2 ->) 3, 1 -> 2
    assert counts.inner_idle_seconds == pytest.approx(0.0010 + 0.0020 + 0.0007)


def test_two_channels_calls_are_all_counted(checkpoint, seed):
    spec = ModelSpec.from_checkpoint(checkpoint)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = ExpertProcess("--model", str(checkpoint), "--metrics-port", str(port),
                           "--call-timing-samples", "16")  # fmt: skip
    config = ktshm.ChannelConfig(num_slots=4, region_bytes=1 << 16)
    channels = [ktshm.Channel.create(config) for _ in range(2)]
    sent: list[list[tuple[int, np.ndarray]]] = [[], []]
    try:
        for ch in channels:
            worker.attach(ch)

        def run(i: int) -> None:
            rng = np.random.default_rng(seed + i)
            for n in range(CALLS_PER_CHANNEL):
                tokens = 1 + n % 4
                layer = spec.moe_layers[n % len(spec.moe_layers)]
                ids = np.stack([rng.permutation(spec.num_experts)[: spec.num_experts_per_tok]
                                for _ in range(tokens)]).astype(np.int32)  # fmt: skip
                ids[rng.random(ids.shape) < 0.2] = -1
                x = rng.standard_normal((tokens, spec.hidden_size), dtype=np.float32)
                moe_call(channels[i], layer, x, ids, rng.random(ids.shape, dtype=np.float32))
                sent[i].append((layer, ids))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        calls = [c for per_channel in sent for c in per_channel]
        assert len(calls) == 2 * CALLS_PER_CHANNEL
        want_tokens = sum(ids.shape[0] for _, ids in calls)
        want_activations = Counter()
        for layer, ids in calls:
            for e in ids[ids >= 0].tolist():
                want_activations[(layer, e)] += 1

        stats = worker.stub.GetStats(pb.StatsRequest(), timeout=10)
        assert (stats.calls, stats.tokens) == (len(calls), want_tokens)
        got = {(a.layer, a.expert): a.count for a in stats.activations}
        assert got == dict(want_activations)
        assert len(stats.call_timings.kernel_ns) == 2 * 16  # each channel's last 16
        assert stats.inner_idle_gaps <= stats.idle_gaps
        assert stats.inner_idle_seconds <= stats.idle_seconds

        samples = scrape(port)
        assert samples["ktserve_expert_moe_calls_total{}"] == len(calls)
        assert samples["ktserve_expert_tokens_total{}"] == want_tokens
        info = worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        per_expert = info.weight_bytes // (spec.num_experts * len(spec.moe_layers))
        want_bytes = sum(len(np.unique(ids[ids >= 0])) * per_expert for _, ids in calls)
        assert stats.weight_bytes_read == want_bytes
        assert samples["ktserve_expert_weight_bytes_read_total{}"] == want_bytes
        per_layer = Counter(layer for layer, _ in calls)
        for layer, n in per_layer.items():
            assert samples[f"ktserve_expert_moe_call_seconds_count{{layer={layer}}}"] == n
            assert samples[f"ktserve_expert_moe_call_seconds_bucket{{layer={layer},le=+Inf}}"] == n
        histogram_sum = sum(samples[f"ktserve_expert_moe_call_seconds_sum{{layer={layer}}}"]
                            for layer in per_layer)  # fmt: skip
        assert histogram_sum == pytest.approx(stats.busy_seconds, rel=1e-9)
        for (layer, expert), n in want_activations.items():
            assert (
                samples[f"ktserve_expert_activations_total{{expert={expert},layer={layer}}}"] == n
            )
    finally:
        worker.close()
        for ch in channels:
            ch.close()
