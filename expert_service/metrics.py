"""The expert worker's Prometheus metrics, on a registry of its own (served on its own port).

The per-call ones (calls, tokens, bytes read, latency, activations) are plain numbers each
channel thread adds to without a lock (CallCounts; the kernel counts activations itself),
summed into metric families at scrape time: a call's bookkeeping is a few additions.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from expert_service.expert_shard import ExpertShard

LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3,
    51.2e-3, 0.1, 0.2, 0.4, 0.8,
)  # fmt: skip


class _Activations:
    """Per-(layer, expert) activation counts, kept in numpy (the kernel adds a call's tokens per
    expert to its layer's row) and exported at scrape time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: np.ndarray | None = None  # [num MoE layers, experts held] int64
        self.row: dict[int, int] = {}
        self.first_expert = 0

    def reset(self, shard: ExpertShard) -> None:
        with self.lock:
            self.row = {layer: i for i, layer in enumerate(sorted(shard.layers))}
            self.counts = np.zeros((len(self.row), len(shard.experts)), dtype=np.int64)
            self.first_expert = shard.experts.start

    def layer_rows(self) -> dict[int, np.ndarray]:
        """Each MoE layer's row [experts held] int64, for the kernel to add to."""
        with self.lock:
            return {layer: self.counts[i] for layer, i in self.row.items()}

    def nonzero(self) -> list[tuple[int, int, int]]:
        with self.lock:
            if self.counts is None:
                return []
            layers = sorted(self.row, key=self.row.get)
            rows, cols = np.nonzero(self.counts)
            return [
                (layers[r], self.first_expert + int(c), int(self.counts[r, c]))
                for r, c in zip(rows, cols)
            ]

    def collect(self):
        family = CounterMetricFamily(
            "ktserve_expert_activations",
            "Tokens routed to each expert this worker holds, by layer",
            labels=["layer", "expert"],
        )
        for layer, expert, count in self.nonzero():
            family.add_metric([str(layer), str(expert)], count)
        yield family


class CallCounts:
    """The MoE calls one channel thread answered. Only that thread writes (NOTE: no lock: a
    scrape may read a call half-counted, never lose one)."""

    __slots__ = ("calls", "tokens", "weight_bytes", "busy_seconds", "phase_seconds", "layers",
                 "idle_seconds", "idle_gaps", "inner_idle_seconds", "inner_idle_gaps")  # fmt: skip

    def __init__(self) -> None:
        self.calls = self.tokens = self.weight_bytes = 0
        self.busy_seconds = 0.0
        # the gaps under worker.IDLE_GAP_S between a reply and the next request, summed, and
        # how many (WorkerStats)
        self.idle_seconds, self.idle_gaps = 0.0, 0
        # of those, the gaps before a later layer's call than the last answered (WorkerStats)
        self.inner_idle_seconds, self.inner_idle_gaps = 0.0, 0
        # seconds summed: dispatch, kernel, publish, bookkeeping (WorkerStats)
        self.phase_seconds = [0.0, 0.0, 0.0, 0.0]
        self.layers: dict[int, list] = {}  # layer -> [bucket counts (LATENCY_BUCKETS, +Inf), sum]

    def add(self, layer: int, num_tokens: int, weight_bytes: int, seconds: float) -> None:
        self.calls += 1
        self.tokens += num_tokens
        self.weight_bytes += weight_bytes
        self.busy_seconds += seconds
        histogram = self.layers.get(layer)
        if histogram is None:
            histogram = self.layers[layer] = [[0] * (len(LATENCY_BUCKETS) + 1), 0.0]
        histogram[0][bisect_left(LATENCY_BUCKETS, seconds)] += 1
        histogram[1] += seconds


class _CallCollector:
    """ktserve_expert_moe_calls / tokens / weight_bytes_read / moe_call_seconds: the channels'
    CallCounts summed at scrape time."""

    def __init__(self, counts: Callable[[], list[CallCounts]]) -> None:
        self.counts = counts

    def collect(self):
        counts = self.counts()
        for name, doc, attr in (
            ("ktserve_expert_moe_calls", "MoE calls answered", "calls"),
            ("ktserve_expert_tokens", "Tokens computed", "tokens"),
            ("ktserve_expert_weight_bytes_read", "Bytes of expert weights streamed",
             "weight_bytes"),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=sum(getattr(c, attr) for c in counts))
        family = HistogramMetricFamily(
            "ktserve_expert_moe_call_seconds", "MoE call latency inside the worker, by layer",
            labels=["layer"],
        )  # fmt: skip
        for layer in sorted({layer for c in counts for layer in c.layers}):
            per_bucket = [0] * (len(LATENCY_BUCKETS) + 1)
            total = 0.0
            for c in counts:
                histogram = c.layers.get(layer)
                if histogram is not None:
                    per_bucket = [a + b for a, b in zip(per_bucket, histogram[0])]
                    total += histogram[1]
            cumulative = np.cumsum(per_bucket).tolist()
            bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
            family.add_metric([str(layer)], list(zip(bounds, cumulative)), total)
        yield family


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._counts: list[CallCounts] = []  # one per channel thread, kept after it ends
        self._counts_lock = threading.Lock()
        r.register(_CallCollector(self.call_counts))
        self.errors = Counter(
            "ktserve_expert_errors", "Calls answered with an error", ["status"], registry=r
        )
        self.in_flight = Gauge("ktserve_expert_calls_in_flight", "MoE calls running", registry=r)
        self.weight_bytes = Gauge(
            "ktserve_expert_weight_bytes", "Packed expert weights held in RAM", registry=r
        )
        self.kernel_info = Gauge(
            "ktserve_expert_kernel_info", "Kernel in use (value 1)", ["isa", "threads"], registry=r
        )
        self.activations = _Activations()
        r.register(self.activations)

    def new_call_counts(self) -> CallCounts:
        """Counts for a new channel thread (summed with every other's)."""
        counts = CallCounts()
        with self._counts_lock:
            self._counts.append(counts)
        return counts

    def call_counts(self) -> list[CallCounts]:
        with self._counts_lock:
            return list(self._counts)

    def set_kernel(self, isa: str, threads: int) -> None:
        self.kernel_info.labels(isa=isa, threads=str(threads)).set(1)

    def set_shard(self, shard: ExpertShard) -> None:
        self.weight_bytes.set(shard.nbytes)
        self.activations.reset(shard)

    def total(self, attr: str) -> float:
        """A CallCounts field summed over the channels."""
        return sum(getattr(c, attr) for c in self.call_counts())

    def phase_seconds(self) -> list[float]:
        phases = [c.phase_seconds for c in self.call_counts()]
        return [sum(p[i] for p in phases) for i in range(4)]
