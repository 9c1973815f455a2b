"""A worker's per-part call timings (--call-timing-samples) against the caller's own clock."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ktshm
from expert_service.call_timing import PARTS
from ktserve import wire
from ktserve.checkpoint import ModelSpec
from ktserve.protocol import expert_pb2 as pb
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.expert_procs import (  # noqa: F401 - no_segments_left_behind is an autouse fixture
    ExpertProcess,
    moe_call,
    no_segments_left_behind,
)

CHECKPOINT = TinyCheckpoint("qwen3_moe")


@pytest.fixture
def channel():
    ch = ktshm.Channel.create(ktshm.ChannelConfig(num_slots=4, region_bytes=1 << 16))
    yield ch
    ch.close()


def call_timings(worker: ExpertProcess) -> dict[str, list[int]]:
    stats = worker.stub.GetStats(pb.StatsRequest(), timeout=10)
    return {part: list(getattr(stats.call_timings, f"{part}_ns")) for part in PARTS}


def test_parts_are_ordered_and_lie_within_the_callers_round_trip(checkpoint, channel, seed):
    spec = ModelSpec.from_checkpoint(checkpoint)
    rng = np.random.default_rng(seed)
    worker = ExpertProcess("--model", str(checkpoint), "--call-timing-samples", "8")
    try:
        worker.attach(channel)
        trips = []
        for i in range(10):  # more than the ring holds: the last 8 are kept
            x = rng.standard_normal((1 + i % 3, spec.hidden_size), dtype=np.float32)
            ids = np.stack(
                [rng.permutation(spec.num_experts)[: spec.num_experts_per_tok] for _ in x]
            )
            w = rng.random(ids.shape, dtype=np.float32)
            t0 = time.monotonic_ns()
            moe_call(channel, spec.moe_layers[i % len(spec.moe_layers)], x, ids, w)
            trips.append(time.monotonic_ns() - t0)
        parts = call_timings(worker)
        assert all(len(v) == 8 for v in parts.values())
        for i, trip in enumerate(trips[-8:]):
            in_worker = sum(parts[p][i] for p in PARTS[:-1])
            assert all(parts[p][i] >= 0 for p in PARTS[:-1]) and parts["kernel"][i] > 0
            # the worker's view (request published -> reply published) lies within the caller's
            assert in_worker <= trip
        assert all(b >= 0 for b in parts["bookkeeping"][:-1]) and parts["bookkeeping"][-1] == -1

        # a call that does not reach the kernel is not recorded, and the call before it has no
        # bookkeeping: its end is not the next recorded call's start
        with pytest.raises(ktshm.RemoteError):
            channel.call(wire.KIND_MOE, 10_000, [np.zeros((1, spec.hidden_size), np.float32),
                         np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)])  # fmt: skip
        x = np.ones((1, spec.hidden_size), np.float32)
        moe_call(channel, spec.moe_layers[0], x, ids[:1], w[:1])
        after = call_timings(worker)
        assert after["kernel"][:-1] == parts["kernel"][1:] and after["bookkeeping"][-2] == -1
    finally:
        worker.close()
