"""bench_moe_kernel's phase split: the table's cells and each pool thread's own medians come from
a real kernel's marks, and the per-thread line names the thread that ends its down work last."""

from __future__ import annotations

import numpy as np
import torch

from bench.bench_moe_kernel import PHASE_CALLS, Series, phase_cells, thread_line
from expert_service.kernels import MoEKernel, pack_experts
from expert_service.kernels.kernel import MARKS

E, H, I, T, K = 8, 128, 64, 4, 2  # noqa: E741


def _series(kernel: MoEKernel, seed: int) -> tuple[Series, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    dims = ((E, I, H), (E, I, H), (E, H, I))  # gate, up, down
    packed = pack_experts(*(torch.randn(*d, generator=gen) * 0.05 for d in dims), "int4")
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=gen)
    out = torch.empty(T, H)
    calls = []

    def call(i: int) -> None:
        calls.append(i)
        kernel.forward(packed, x, ids, w, out)

    return Series("int4 x1L", "int4", T, "bf16", False, 1.0, 1.0, call, kernel=kernel), calls


def test_phase_cells_split_real_calls_and_keep_each_threads_medians(seed):
    with MoEKernel(2) as kernel:
        s, calls = _series(kernel, seed)
        cells, per_thread = phase_cells("tiny", s)
    assert calls == list(range(PHASE_CALLS))
    assert per_thread.shape == (2, len(MARKS))
    # each thread's marks in the order the call passes them
    assert np.all(np.diff(per_thread, axis=1) >= 0), per_thread
    assert cells[:3] == ["tiny", "int4 x1L", str(T)]
    first, last = (float(v) for v in cells[7].split("-"))  # down done: first-last thread
    assert first <= last and last > 0
    assert float(cells[9]) >= last  # the call returns after its threads' down work


def test_thread_line_names_the_thread_that_ends_its_down_work_last():
    per_thread = np.zeros((4, len(MARKS)))
    per_thread[:, MARKS.index("gate_up_done")] = [100, 101, 102, 103]
    per_thread[:, MARKS.index("down_done")] = [200, 260, 201, 202]
    s = Series("int4 x3L", "int4", 16, "bf16", False, 1.0, 1.0, lambda i: None)
    line = thread_line(s, per_thread)
    assert "T=16" in line and "0:100/200 1:101/260 2:102/201 3:103/202" in line
    assert line.endswith("last: thread 1, 58.5 us past the median thread")
