"""What /metrics serves: a server's registry, with constant labels added when it has any."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


class Labelled:
    """The metrics of `registry` with constant labels added to every sample, e.g. the partition
    of θ a server holds (`partition="1"`): K partitions scraped as one target (gemps server
    --partitions K) or as K pods still give one series per partition."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry = registry
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**sample.labels, **self._labels}) for sample in family.samples]
            yield labelled


def exposed(registry: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """What to serve on /metrics: `registry` itself, or with `labels` added when there are any."""
    if not labels:
        return registry
    outer = CollectorRegistry(auto_describe=True)
    outer.register(Labelled(registry, labels))
    return outer
