"""The few most-damped and slowest workers of the last minute: the stragglers an operator looks for.

Per-worker series would cost one series per worker per family (and new ones whenever workers
come and go); these are the `STRAGGLERS` highest-ranked only, labelled `rank` ("1".."5": a fixed
set, so a panel or an alert on rank 1 reads one series) and `worker` (the worker's name, the
value that changes). A scrape exposes at most STRAGGLERS series per family, whatever the number
of workers; over a job's life Prometheus holds one series per (rank, name) that ever ranked,
at most STRAGGLERS times the distinct worker names (docs/OBSERVABILITY.md). The rankings are
gemps_proto.status's (`most_damped`, `slowest`), the ones `gemps status` prints, over the
figures Status lists per worker (domain/recent.py), read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gemps_proto.status import WorkerStatus, most_damped, slowest

#: workers each ranking exports
STRAGGLERS = 5
LABELS = ("rank", "worker")
_WINDOW = "over the last minute"


def worker_label(worker: WorkerStatus) -> str:
    """The `worker` label: its name, else its shard (a name "" would drop the label)."""
    return worker.name or f"shard {worker.shard}"


class StragglerCollector(Collector):
    """Reads the registered workers at each scrape and exports the top STRAGGLERS of each ranking."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._workers: Callable[[], Sequence[WorkerStatus]] = tuple  # none until observed
        registry.register(self)

    def observe(self, workers: Callable[[], Sequence[WorkerStatus]]) -> None:
        """Read `workers` (the registry's listing) at each scrape."""
        self._workers = workers

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())  # the names only: registering reads no worker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        workers = self._workers()
        damped_scaling, damped_zero, damped_staleness, slow_rate, slow_staleness = families = self._families()
        for rank, worker in enumerate(most_damped(workers, STRAGGLERS), start=1):
            labels = [str(rank), worker_label(worker)]
            damped_scaling.add_metric(labels, worker.recent.scaling_mean)
            damped_zero.add_metric(labels, worker.recent.scaling_at_zero)
            damped_staleness.add_metric(labels, worker.recent.staleness)
        for rank, worker in enumerate(slowest(workers, STRAGGLERS), start=1):
            labels = [str(rank), worker_label(worker)]
            slow_rate.add_metric(labels, worker.recent.rate)
            slow_staleness.add_metric(labels, worker.recent.staleness)
        return iter(families)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        damped = (
            f"The {STRAGGLERS} workers whose commits the rule scaled down most {_WINDOW} (rank 1: the lowest mean pi)"
        )
        slow = f"The {STRAGGLERS} workers with the fewest commits a second {_WINDOW} (rank 1: the slowest)"
        return [
            GaugeMetricFamily("gemps_damped_worker_scaling", f"{damped}: its mean pi over its commits.", labels=LABELS),
            GaugeMetricFamily(
                "gemps_damped_worker_scaling_at_zero_ratio",
                f"{damped}: the fraction of its parameters scaled by 0, averaged over its commits.",
                labels=LABELS,
            ),
            GaugeMetricFamily(
                "gemps_damped_worker_staleness", f"{damped}: its commits' mean staleness.", labels=LABELS
            ),
            GaugeMetricFamily(
                "gemps_slowest_worker_commits_per_second",
                f"{slow}: its commits a second (0: registered, silent).",
                labels=LABELS,
            ),
            GaugeMetricFamily("gemps_slowest_worker_staleness", f"{slow}: its commits' mean staleness.", labels=LABELS),
        ]
