"""The host's DRAM read rate, measured: what bounds a CPU expert worker's decode (each routed
expert's weights are read once per step). Shared by the benchmarks and `ktserve plan`."""

from __future__ import annotations

import time


def dram_read_gbs(threads: int, gb: float) -> float:
    """Best of 4 torch.sum passes over a buffer of `gb` GB at `threads` torch threads."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(int(gb * 1e9) // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(4):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best
