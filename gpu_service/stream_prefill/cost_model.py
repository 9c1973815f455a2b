"""When streaming a layer's experts to the GPU beats the CPU workers, from what this machine
measures at start-up:

    cpu(T)      = cpu_fixed_s + cpu_s_per_token * T        (calibration calls to the workers)
    streamed(T) = max(layer_bytes / h2d_bytes_per_s,       (the copy of layer L+1 runs while
                      gpu_fixed_s + gpu_s_per_token * T)    layer L computes: the slower one)
    a chunk of T prefill tokens streams when T >= min_tokens: the least T from which on every
    chunk streams faster (None if there is none: the CPU is faster per token).
Each side is a line through two measured sizes; the CPU's per-token cost falls with T (larger
tiles), so one measured at a few hundred tokens errs towards streaming.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StreamCost:
    layer_bytes: int
    h2d_bytes_per_s: float
    gpu_fixed_s: float
    gpu_s_per_token: float
    cpu_s_per_token: float
    cpu_fixed_s: float = 0.0

    def cpu_s(self, num_tokens: int) -> float:
        return self.cpu_fixed_s + self.cpu_s_per_token * num_tokens

    def streamed_s(self, num_tokens: int) -> float:
        transfer = self.layer_bytes / self.h2d_bytes_per_s
        return max(transfer, self.gpu_fixed_s + self.gpu_s_per_token * num_tokens)

    @property
    def min_tokens(self) -> int | None:
        """The least chunk from which on streaming is faster; None when the CPU's cost grows
        slower with T (whatever a smaller chunk does)."""
        margin = self.cpu_s_per_token - self.gpu_s_per_token
        if margin <= 0:
            return None
        transfer = self.layer_bytes / self.h2d_bytes_per_s
        tokens = max((transfer - self.cpu_fixed_s) / self.cpu_s_per_token,
                     (self.gpu_fixed_s - self.cpu_fixed_s) / margin)  # fmt: skip
        return max(1, math.floor(tokens) + 1)

    def describe(self) -> str:
        n = self.min_tokens
        head = f"chunks >= {n} tokens stream experts to the GPU"
        if n is None:
            head = "no chunk streams experts to the GPU (the CPU workers are faster)"
        return (
            f"prefill: {head} (PCIe {self.h2d_bytes_per_s / 1e9:.1f} GB/s, "
            f"{self.layer_bytes / 2**20:.0f} MiB per MoE layer = "
            f"{self.layer_bytes / self.h2d_bytes_per_s * 1e3:.2f} ms; GPU "
            f"{self.gpu_fixed_s * 1e3:.2f} ms + {self.gpu_s_per_token * 1e6:.2f} us/token; "
            f"CPU workers {self.cpu_fixed_s * 1e3:.2f} ms + {self.cpu_s_per_token * 1e6:.2f} "
            "us/token; per MoE layer)"
        )


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 2) -> float:
    """Best wall time of fn() in seconds, the device synchronized around it (one warm-up)."""
    best = math.inf
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def linear_fit(sizes: tuple[int, int], seconds: tuple[float, float]) -> tuple[float, float]:
    """(fixed, per unit) through two measurements, both clamped at >= 0."""
    (a, b), (ta, tb) = sizes, seconds
    per = max((tb - ta) / (b - a), 0.0)
    return max(ta - per * a, 0.0), per
