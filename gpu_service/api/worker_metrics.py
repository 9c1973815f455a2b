"""Each expert worker's state as the Prometheus gauge ktserve_worker_up, read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

NAME = "ktserve_worker_up"
HELP = "1 while the expert worker serves its shard, 0 while it is down (dead, restarting, loading)"
LABELS = ["worker", "address", "experts"]


class WorkerUpCollector:
    """worker_status: rows with "index", "address", "experts" and "alive" (as /health shows)."""

    def __init__(self, worker_status: Callable[[], list[dict]]) -> None:
        self.worker_status = worker_status

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(NAME, HELP, labels=LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(NAME, HELP, labels=LABELS)
        for row in self.worker_status():
            labels = [str(row["index"]), row["address"], row["experts"]]
            up.add_metric(labels, 1.0 if row["alive"] else 0.0)
        yield up


def worker_registry(worker_status: Callable[[], list[dict]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerUpCollector(worker_status))
    return registry
