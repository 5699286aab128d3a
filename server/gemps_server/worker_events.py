"""What the server logs and counts when a worker joins, leaves or is evicted.

The service (service.py) decides; this writes the lines operators read ("worker joined", "worker
left", "worker evicted") and counts them in the metrics. A worker given a data shard another
registered worker holds (more workers than --num-shards: the indices wrap) is a WARNING and
`gemps_shared_shard_registrations_total`: the two read the same batches, which nothing else shows.
A name found shared by two live processes is a WARNING too ("worker name shared"): it keeps a
restart under that name waiting for its dead namesake's lease.
"""

from __future__ import annotations

import logging

from gemps_proto.schema import Shard
from gemps_server.domain.workers import WorkerRecord
from gemps_server.logs import event
from gemps_server.metrics import ServerMetrics

log = logging.getLogger("gemps.server")


def joined(metrics: ServerMetrics, worker: WorkerRecord, shard: Shard, active: int, version: int) -> None:
    """`worker` registered and was given `shard`; `active` workers are registered now."""
    metrics.registered()
    event(
        log,
        "worker joined",
        worker_id=worker.worker_id,
        name=worker.name or None,
        shard=shard.index,
        shards=shard.count,
        active=active,
        version=version,
    )
    if shard.shared_with:
        metrics.shared_shard()
        event(
            log,
            "shard shared",
            level=logging.WARNING,
            worker_id=worker.worker_id,
            name=worker.name or None,
            shard=shard.index,
            shards=shard.count,
            shared_with=shard.shared_with,
            active=active,
            detail="more workers than --num-shards: workers holding one shard read the same batches",
        )


def name_shared(worker: WorkerRecord) -> None:
    """`worker`'s client registered again after a newer registration of its name superseded it as
    a dead process's (domain/namesakes.py): two live processes share its name. Said once a name."""
    event(
        log,
        "worker name shared",
        level=logging.WARNING,
        worker_id=worker.worker_id,
        name=worker.name,
        detail="another live process registers under this name (give each worker its own --name, GEMPS_NAME or "
        "Client(name=...)); its registration now holds the whole lease until its pace shows, so a restart "
        "under it waits that long for its dead namesake's place",
    )


def left(metrics: ServerMetrics, worker: WorkerRecord, active: int) -> None:
    """`worker` left cleanly (Leave); `active` workers remain."""
    metrics.departed("left")
    event(
        log, "worker left", worker_id=worker.worker_id, name=worker.name or None, commits=worker.commits, active=active
    )


def evicted(metrics: ServerMetrics, workers: list[WorkerRecord], reason: str, lease_ttl: float, active: int) -> None:
    """The server forgot `workers` without their leaving, for `reason`."""
    metrics.departed("evicted", len(workers))
    for worker in workers:
        event(
            log,
            "worker evicted",
            level=logging.WARNING,
            worker_id=worker.worker_id,
            name=worker.name or None,
            reason=reason,
            lease_ttl_seconds=lease_ttl,
            commits=worker.commits,
            active=active,
        )
