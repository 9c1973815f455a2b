"""When streaming a layer's experts to the GPU beats the CPU workers, from what this machine
measures at start-up:

    cpu(T)      = cpu_fixed_s + cpu_s_per_expert * distinct(T) + cpu_s_per_token * T
    distinct(T) = E * (1 - (1 - k / E) ** T)              (experts T tokens touch, routed
                                                          k of E uniformly: each one is read once)
    streamed(T) = max(layer_bytes / h2d_bytes_per_s,       (the copy of layer L+1 runs while
                      gpu_fixed_s + gpu_s_per_token * T)    layer L computes: the slower one)
    a chunk of T prefill tokens streams when T >= min_tokens: the least T from which on every
    chunk up to max_tokens streams faster (None if there is none).
The CPU's side is fitted to calibration calls to the workers at several sizes (fit_cpu): a call
of a few tokens reads a few experts, one of a few hundred reads nearly all of them, so a line
through two sizes overstates a short chunk's cost by the reads it does not make.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

MAX_TOKENS = 1 << 16  # the largest chunk the threshold is searched over, by default


@dataclass(frozen=True)
class CpuCost:
    """The CPU workers' time for one MoE layer's call of T tokens (see the module docstring)."""

    num_experts: int
    experts_per_token: int
    fixed_s: float = 0.0
    s_per_expert: float = 0.0
    s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"top-{self.experts_per_token} of {self.num_experts} experts")
        if min(self.fixed_s, self.s_per_expert, self.s_per_token) < 0:
            raise ValueError(f"negative CPU cost terms: {self}")

    def distinct(self, num_tokens):
        """Expected experts that num_tokens tokens (an int or an array) touch."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** np.asarray(num_tokens, dtype=np.float64))

    def seconds(self, num_tokens):
        t = np.asarray(num_tokens, dtype=np.float64)
        return self.fixed_s + self.s_per_expert * self.distinct(t) + self.s_per_token * t

    def describe(self) -> str:
        return (f"CPU workers {self.fixed_s * 1e3:.2f} ms + {self.s_per_expert * 1e3:.3f} ms per "
                f"expert read + {self.s_per_token * 1e6:.2f} us/token")  # fmt: skip


def fit_cpu(num_experts: int, experts_per_token: int, sizes: Sequence[int],
            seconds: Sequence[float]) -> CpuCost:  # fmt: skip
    """The CpuCost whose nonnegative terms fit the measured (size, seconds) best in least squares:
    every subset of the three terms is solved, the best one with no negative term kept."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need two or more (size, seconds) pairs, got {sizes} and {seconds}")
    shape = CpuCost(num_experts, experts_per_token)
    t = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    columns = np.stack([np.ones_like(t), shape.distinct(t), t], axis=1)  # [N, 3]
    best, best_residual = np.zeros(3), float(np.sum(y * y))
    for n in (1, 2, 3):
        for terms in itertools.combinations(range(3), n):
            a = columns[:, terms]
            coef, *_ = np.linalg.lstsq(a, y, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((a @ coef - y) ** 2))
            if residual < best_residual * (1 - 1e-9):
                best, best_residual = np.zeros(3), residual
                best[list(terms)] = coef
    return CpuCost(num_experts, experts_per_token, *map(float, best))


@dataclass(frozen=True)
class StreamCost:
    layer_bytes: int
    h2d_bytes_per_s: float
    gpu_fixed_s: float
    gpu_s_per_token: float
    cpu: CpuCost
    max_tokens: int = MAX_TOKENS

    def cpu_s(self, num_tokens: int) -> float:
        return float(self.cpu.seconds(num_tokens))

    def streamed_s(self, num_tokens: int) -> float:
        return float(self._streamed(np.float64(num_tokens)))

    def _streamed(self, t: np.ndarray) -> np.ndarray:
        transfer = self.layer_bytes / self.h2d_bytes_per_s
        return np.maximum(transfer, self.gpu_fixed_s + self.gpu_s_per_token * t)

    @cached_property
    def min_tokens(self) -> int | None:
        """The least chunk from which on (up to max_tokens) every chunk streams faster; None
        when the largest one does not."""
        t = np.arange(1, self.max_tokens + 1, dtype=np.float64)
        slower = np.flatnonzero(~(self._streamed(t) < self.cpu.seconds(t)))
        if slower.size == 0:
            return 1
        last = int(slower[-1]) + 1  # the largest T that does not stream faster
        return None if last == self.max_tokens else last + 1

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
            f"{self.cpu.describe()}; per MoE layer)"
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
