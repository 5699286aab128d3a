"""Prometheus metrics of one server instance (its own registry, so several can share a process).

Names follow Prometheus conventions: base units (`_seconds`, `_bytes`, `_ratio`), `_total` on
counters, and label values from small fixed sets (outcome, rejection reason, RPC method, phase,
...), so 100 workers cost no more series than one. The one per-worker label is the stragglers'
(`stragglers`): the few most-damped and slowest workers by rank, their names as a label value.
docs/OBSERVABILITY.md lists every metric with the dashboard panel that shows it.

Each concern declares its families in its own module, into the registry it is given: `info` (the
process, the announced training config), `commits`, `scaling` (the rule's π and GEM's energies),
`traffic` (RPCs and bytes per plane and method, the data plane's guards), `state` (workers and θ),
`stragglers` (the few most-damped and slowest workers), `noise` (the gradient noise scale),
`reliability` (checkpoints, duplicates, refused requests) and `evaluation` (held-out figures);
`server_metrics.ServerMetrics` composes them into one registry, and `exposition` serves it.
What every commit or request records (commits, scaling, traffic's per-request series) is
`accumulators`' families: a few additions an event into per-thread arrays, summed at scrape;
the rest is prometheus_client's own.
Replication's series live with replication (gemps_server.replication.metrics), which registers
them when a partition is replicated.
"""

from __future__ import annotations

from gemps_server.metrics.commits import COMMIT_REJECTION_REASONS
from gemps_server.metrics.evaluation import MAX_DATASET_LABEL, MAX_DATASET_LABELS
from gemps_server.metrics.exposition import Labelled, exposed
from gemps_server.metrics.server_metrics import ServerMetrics

__all__ = [
    "COMMIT_REJECTION_REASONS",
    "MAX_DATASET_LABEL",
    "MAX_DATASET_LABELS",
    "Labelled",
    "ServerMetrics",
    "exposed",
]
