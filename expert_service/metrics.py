"""The expert worker's Prometheus metrics, on a registry of its own (served on its own port)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from expert_service.expert_shard import ExpertShard

LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3,
    51.2e-3, 0.1, 0.2, 0.4, 0.8,
)  # fmt: skip


class _Activations:
    """Per-(layer, expert) activation counts, kept in numpy and exported at scrape time."""

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

    def add(self, layer: int, local_ids: np.ndarray) -> int:
        """Count the call's tokens per expert; returns how many distinct experts it used."""
        used = local_ids[local_ids >= 0]
        with self.lock:
            row = self.counts[self.row[layer]]
            counts = np.bincount(used, minlength=row.shape[0])
            row += counts
        return int(np.count_nonzero(counts))

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


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.call_seconds = Histogram(
            "ktserve_expert_moe_call_seconds", "MoE call latency inside the worker, by layer",
            ["layer"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("ktserve_expert_tokens", "Tokens computed", registry=r)
        self.calls = Counter("ktserve_expert_moe_calls", "MoE calls answered", registry=r)
        self.weight_bytes_read = Counter(
            "ktserve_expert_weight_bytes_read", "Bytes of expert weights streamed", registry=r
        )
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
        self.busy_seconds = 0.0
        self.activations = _Activations()
        r.register(self.activations)
        self._lock = threading.Lock()
        self.num_calls = self.num_tokens = self.num_bytes = 0

    def set_kernel(self, isa: str, threads: int) -> None:
        self.kernel_info.labels(isa=isa, threads=str(threads)).set(1)

    def set_shard(self, shard: ExpertShard) -> None:
        self.weight_bytes.set(shard.nbytes)
        self.activations.reset(shard)

    def observe_call(
        self, shard: ExpertShard, layer: int, local_ids: np.ndarray, seconds: float
    ) -> None:
        touched = self.activations.add(layer, local_ids)
        nbytes = touched * shard.expert_nbytes
        num_tokens = local_ids.shape[0]
        self.call_seconds.labels(layer=str(layer)).observe(seconds)
        self.tokens.inc(num_tokens)
        self.calls.inc()
        self.weight_bytes_read.inc(nbytes)
        with self._lock:
            self.num_calls += 1
            self.num_tokens += num_tokens
            self.num_bytes += nbytes
            self.busy_seconds += seconds
