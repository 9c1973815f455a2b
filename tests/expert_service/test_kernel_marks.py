"""MoEKernel.last_marks: where each pool thread was in the last forward call. The marks follow
the call's phases in order, every thread's, and the barriers between phases show: no thread
leaves one before every thread has reached it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expert_service.kernels import MoEKernel, available_isas, pack_experts
from expert_service.kernels.kernel import MARKS

E, H, I, K = 8, 256, 128, 2  # noqa: E741
THREADS = 3
COL = {name: i for i, name in enumerate(MARKS)}


@pytest.fixture(scope="module")
def packed():
    gen = torch.Generator().manual_seed(7)
    g, u = (torch.randn(E, I, H, generator=gen) * 0.05 for _ in range(2))
    d = torch.randn(E, H, I, generator=gen) * 0.05
    return pack_experts(g, u, d, "int4")


def _call(kern: MoEKernel, packed, tokens: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).int()
    kern.forward(packed, x, ids, torch.rand(tokens, K, generator=gen), torch.empty(tokens, H))


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("tokens", [1, 16, 40])  # few tokens (slot-wise down) up to 16; then many
def test_marks_follow_the_phases_and_the_barriers(packed, isa, tokens, seed):
    with MoEKernel(THREADS, isa) as kern:
        assert not kern.last_marks().any()  # before a call
        _call(kern, packed, tokens, seed)
        marks = kern.last_marks()
        start, end, _ = kern.last_forward()
    assert marks.shape == (THREADS, len(MARKS))
    assert (marks >= 0).all() and (marks <= end - start).all()
    assert (np.diff(marks, axis=1) >= 0).all(), marks  # each thread's phases in order
    # Barriers: after the activations' and the gather's, nobody is earlier than anybody before
    # (one token with distinct experts needs no gather: its row serves every expert).
    barriers = [("started", "prepared")] + ([("prepared", "gathered")] if tokens > 1 else [])
    for before, after in barriers:
        assert marks[:, COL[after]].min() >= marks[:, COL[before]].max(), (before, after, marks)
    if tokens > 16:  # many tokens: down begins after everybody's gate/up (and h prepared)
        assert marks[:, COL["down_started"]].min() >= (marks[:, COL["gate_up_done"]].max()), marks
    else:  # few tokens: down items follow a thread's gate/up items without a barrier
        assert (marks[:, COL["down_started"]] == marks[:, COL["gate_up_done"]]).all()


def test_marks_of_a_closed_kernel_are_refused(packed):
    kern = MoEKernel(2)
    kern.close()
    with pytest.raises(ValueError, match="closed"):
        kern.last_marks()
