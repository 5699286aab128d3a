"""A replica's replication series (docs/OBSERVABILITY.md), built from its status record at each
scrape and registered into the server's registry beside the other concerns' metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from gemps_server.replication.status import PRIMARY, ROLES, ReplicationStatus

ReplicationReading = Callable[[], ReplicationStatus | None]
#: the replicas a partition without an in-sync list in etcd waits for (layer.Replicated.waiting_for)
WaitingReading = Callable[[], tuple[str, ...]]
#: connections the replication listener turned away, by reason (listener.Refusals.counts)
RefusalsReading = Callable[[], Mapping[str, int]]


class ReplicationCollector:
    """A replica's replication series, built from its status record at each scrape: a backup
    gone from the record is gone from the page (no stale `backup` label), and nothing at all is
    exported while the provider says None (the partition is not replicated). The `backup` label
    takes the names of the partition's R-1 backups: a small set, like the other labels here.

    Registers itself into `registry`; make one per registry, when the partition is replicated."""

    def __init__(
        self,
        registry: CollectorRegistry,
        provider: ReplicationReading,
        waiting: WaitingReading = tuple,
        refusals: RefusalsReading = dict,
    ) -> None:
        self._provider = provider
        self._waiting = waiting
        self._refusals = refusals
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        status = self._provider()
        if status is None:
            return
        yield from _replica_families(status)
        yield _gauge(
            "gemps_replication_waiting_for_replicas",
            "Replicas that have not reported their state while etcd holds no in-sync list (a fresh job, or etcd "
            "lost its data): above 0, the partition has no primary, as no replica can prove it holds every "
            "acknowledged commit.",
            len(self._waiting()),
        )
        if status.role == PRIMARY:  # what only a primary knows: its backups
            yield from _primary_families(status)
        yield from _replication_counters(status)
        refused = CounterMetricFamily(
            "gemps_replication_refusals",
            "Connections the replication listener closed or refused before or during a backup's handshake, by "
            "reason (DESIGN §3d, the door).",
            labels=["reason"],
        )
        for reason, count in sorted(self._refusals().items()):
            refused.add_metric([reason], count)
        yield refused


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _replica_families(status: ReplicationStatus) -> Iterator[Metric]:
    # Every role's series, 1 for the current one: a role change flips values, series never vanish.
    role = GaugeMetricFamily(
        "gemps_replica_role",
        "This replica's role: 1 for the current one (primary, backup, candidate).",
        labels=["role"],
    )
    for name in ROLES:
        role.add_metric([name], float(status.role == name))
    yield role
    yield _gauge(
        "gemps_replica_epoch", "The primary's epoch this replica holds or follows (0: none known).", status.epoch
    )
    yield _gauge("gemps_replicas_configured", "Replicas the partition is meant to have (R).", status.replicas)


def _primary_families(status: ReplicationStatus) -> Iterator[Metric]:
    yield _gauge(
        "gemps_replicas_live",
        "Replicas acknowledging commits, as the primary counts them: itself and its in-sync backups.",
        status.live,
    )
    yield _gauge(
        "gemps_partition_under_replicated",
        "1 while fewer replicas acknowledge commits than configured (live < R), as the primary sees it.",
        float(status.under_replicated),
    )
    lag_commits = GaugeMetricFamily(
        "gemps_replication_lag_commits",
        "Journal entries forwarded or queued that a backup has not acknowledged.",
        labels=["backup"],
    )
    lag_seconds = GaugeMetricFamily(
        "gemps_replication_lag_seconds",
        "Age of the oldest journal entry a backup has not acknowledged (0 when none).",
        labels=["backup"],
    )
    in_sync = GaugeMetricFamily(
        "gemps_replication_in_sync", "1 while a backup is in the in-sync set (commits wait for it).", labels=["backup"]
    )
    for backup in status.backups:
        lag_commits.add_metric([backup.name], backup.lag_commits)
        lag_seconds.add_metric([backup.name], backup.lag_seconds)
        in_sync.add_metric([backup.name], float(backup.in_sync))
    yield from (lag_commits, lag_seconds, in_sync)


def _replication_counters(status: ReplicationStatus) -> Iterator[Metric]:
    # Counts over the process's life, as the record keeps them: counters (a restart resets them).
    yield CounterMetricFamily(
        "gemps_replication_forwarded", "Journal entries this replica forwarded to backups.", value=status.forwarded
    )
    yield CounterMetricFamily(
        "gemps_replication_applied", "Journal entries this replica applied from a primary.", value=status.applied
    )
    yield CounterMetricFamily("gemps_failovers", "Times this replica became primary.", value=status.failovers)
