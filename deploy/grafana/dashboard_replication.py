"""The server dashboard's row of replicated partitions (gemps_server.replication): roles, epochs,
failovers, live replicas and the backups' lag."""

from __future__ import annotations

from dashboard_panels import PARTITION, RATE, Query, stat, timeseries
from grafana_foundation_sdk.builders import dashboard as dashboard_builders


def replication_row(d: dashboard_builders.Dashboard) -> None:
    """Replicated partitions (gemps_server.replication): every replica exports its role and
    epoch; only a primary its backups' lag and the live count. Empty while R=1 (nothing exported):
    the row is collapsed, so a stack without replicas shows no panel reading "No data" (issue 60);
    a click on it opens it."""
    row = dashboard_builders.Row("Replication")
    row.with_panel(
        stat(
            "Under-replicated partitions",
            "Partitions whose primary counts fewer replicas acknowledging commits (itself and its in-sync "
            "backups) than configured (R). Above 0, a further loss could lose acknowledged commits.",
            [Query("sum(gemps_partition_under_replicated)", "under-replicated")],
        )
    )
    row.with_panel(
        stat(
            "Primaries per partition",
            "Replicas holding the primary role, per partition: 1 is healthy; 0 means a failover is under way "
            "(workers' commits wait).",
            [Query('sum by (partition) (gemps_replica_role{role="primary"})', f"primaries {PARTITION}")],
        )
    )
    row.with_panel(
        stat(
            "Epoch",
            "The highest primary epoch per partition: it rises by at least one at every failover.",
            [Query("max by (partition) (gemps_replica_epoch)", f"epoch {PARTITION}")],
        )
    )
    row.with_panel(
        stat(
            "Failovers (1h)",
            "Times a replica became primary over the last hour, all partitions.",
            [Query("sum(increase(gemps_failovers_total[1h]))", "failovers")],
        )
    )
    row.with_panel(
        timeseries(
            "Replicas by role",
            "Replicas in each role (primary, backup, candidate: looking for a primary), per partition.",
            [Query("sum by (role, partition) (gemps_replica_role)", f"{{{{role}}}} {PARTITION}")],
            minimum=0,
        )
    )
    row.with_panel(
        timeseries(
            "Epoch per replica",
            "The primary's epoch each replica holds or follows: a replica behind the others has not yet "
            "heard of the latest failover.",
            [Query("gemps_replica_epoch", f"{{{{instance}}}} {PARTITION}")],
            minimum=0,
        )
    )
    row.with_panel(
        timeseries(
            "Live replicas vs configured",
            "Per partition, as its primary counts them: replicas acknowledging commits (the primary and its "
            "in-sync backups) against R, and backups out of the in-sync set.",
            [
                Query("max by (partition) (gemps_replicas_live)", f"live {PARTITION}"),
                Query("max by (partition) (gemps_replicas_configured)", f"configured {PARTITION}"),
                Query("sum by (partition) (1 - gemps_replication_in_sync)", f"out of sync {PARTITION}"),
            ],
            minimum=0,
        )
    )
    row.with_panel(
        timeseries(
            "Journal entries forwarded and applied per second",
            "State changes each primary forwards to its backups, and each backup applies, per second.",
            [
                Query(f"rate(gemps_replication_forwarded_total[{RATE}])", f"forwarded {{{{instance}}}} {PARTITION}"),
                Query(f"rate(gemps_replication_applied_total[{RATE}])", f"applied {{{{instance}}}} {PARTITION}"),
            ],
            unit="ops",
            minimum=0,
        )
    )
    row.with_panel(
        timeseries(
            "Replication lag (commits)",
            "Journal entries each backup has not acknowledged, as its primary sees them.",
            [Query("gemps_replication_lag_commits", f"{{{{backup}}}} {PARTITION}")],
            minimum=0,
        )
    )
    row.with_panel(
        timeseries(
            "Replication lag (seconds)",
            "Age of the oldest journal entry each backup has not acknowledged (0: caught up).",
            [Query("gemps_replication_lag_seconds", f"{{{{backup}}}} {PARTITION}")],
            unit="s",
            minimum=0,
        )
    )
    d.with_row(row)  # last: every panel is inside it, collapsed
