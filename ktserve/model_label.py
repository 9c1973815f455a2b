"""/metrics with a model_name label on every sample (as vLLM labels its metrics), added at
scrape time to whatever the registries beneath collect, so the metrics themselves stay plain.
The GPU service labels its own with the served name; an expert worker with the same name
(--served-model-name, or its model directory's name as `ktserve serve` would name it), so one
dashboard variable selects a deployment's GPU service and workers together."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

LABEL = "model_name"


class ModelNameCollector:
    """model_name: the label's value, or a function that gives it at each scrape."""

    def __init__(self, registries: Sequence[CollectorRegistry],
                 model_name: str | Callable[[], str]) -> None:  # fmt: skip
        self.registries = tuple(registries)
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # NOTE: nothing to check at registration: the names are the registries'

    def collect(self) -> Iterator[Metric]:
        name = self.model_name() if callable(self.model_name) else self.model_name
        for registry in self.registries:
            for family in registry.collect():
                labeled = Metric(family.name, family.documentation, family.type, family.unit)
                labeled.samples = [
                    s._replace(labels={LABEL: name, **s.labels}) for s in family.samples
                ]
                yield labeled


def labeled_registry(registries: Sequence[CollectorRegistry],
                     model_name: str | Callable[[], str]) -> CollectorRegistry:  # fmt: skip
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelNameCollector(registries, model_name))
    return registry
