"""/metrics with a model_name label on every sample (as vLLM labels its metrics), added at
scrape time to whatever the registries beneath collect, so the metrics themselves stay plain."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

LABEL = "model_name"


class ModelNameCollector:
    def __init__(self, registries: Sequence[CollectorRegistry], model_name: str) -> None:
        self.registries = tuple(registries)
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # NOTE: nothing to check at registration: the names are the registries'

    def collect(self) -> Iterator[Metric]:
        for registry in self.registries:
            for family in registry.collect():
                labeled = Metric(family.name, family.documentation, family.type, family.unit)
                labeled.samples = [
                    s._replace(labels={LABEL: self.model_name, **s.labels}) for s in family.samples
                ]
                yield labeled


def labeled_registry(registries: Sequence[CollectorRegistry], model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelNameCollector(registries, model_name))
    return registry
