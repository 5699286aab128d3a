"""What Status and a registration report of this server, read without the applier.

The event loop reads while the applier writes: a field stale by one commit is fine in a Status,
and the layout's ranges depend only on θ's size, set once. The service (service.py) hands these
functions what it holds; the data plane's offer is the one record kept here.
"""

from __future__ import annotations

from collections.abc import Sequence

from gemps_proto import versions
from gemps_proto.schema import (
    DataPlane,
    Evaluation,
    Layout,
    ParameterSpec,
    Partition,
    partition_bounds,
)
from gemps_proto.status import ReplicationStatus, ServerStatus
from gemps_server.config import ServerConfig
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRecord
from gemps_server.partition_addresses import PartitionAddresses
from gemps_server.security import Tickets


class DataPlaneOffer:
    """The data plane as registrations and Status announce it: its port once it listens (None:
    off), the name of its local socket for clients on this host ("": none), and the tickets a
    registration carries (one key for every replica of a replicated partition)."""

    def __init__(self, tickets: Tickets) -> None:
        self.port: int | None = None
        self.local_socket = ""
        self.tickets = tickets

    def listening(self, port: int, local_socket: str) -> None:
        self.port, self.local_socket = port, local_socket

    def for_worker(self, worker: WorkerRecord) -> DataPlane | None:
        """As `worker`'s registration announces it: with the ticket it presents there."""
        if self.port is None:
            return None
        return DataPlane(self.port, self.tickets.issue(worker.worker_id, worker.client_id), self.local_socket)

    def announced(self) -> DataPlane | None:
        """As Status announces it: no ticket (that is a registration's)."""
        return None if self.port is None else DataPlane(self.port, b"", self.local_socket)


def partition_layout(
    config: ServerConfig, spec: Sequence[ParameterSpec], addresses: PartitionAddresses
) -> Layout | None:
    """How θ is partitioned, as this partition announces it (None: this server holds all of θ).
    Ranges are all empty until θ is initialised; addresses are "" where this process was
    not told them (only partition 0 must know: workers learn the layout from it), as they are
    now: a partition moved by its launcher is announced where it went."""
    if config.partitions == 1:
        return None
    total = sum(entry.size for entry in spec)
    announced = addresses.current() or ("",) * config.partitions
    bounds = partition_bounds(total, config.partitions)
    partitions = tuple(Partition(a, start, stop) for a, (start, stop) in zip(announced, bounds, strict=True))
    return Layout(config.partition, partitions, total)


def server_status(
    config: ServerConfig,
    state: ServerState,
    *,
    commits_rejected: int,
    uptime_seconds: float,
    last_evaluation: Evaluation | None,
    layout: Layout | None,
    replication: ReplicationStatus | None,
    data_plane: DataPlane | None,
) -> ServerStatus:
    """The Status reply's record: the state's figures now, with what the service counted."""
    return ServerStatus(
        initialized=state.core.initialized,
        version=state.core.version,
        active_workers=len(state.registry),
        num_parameters=state.core.num_parameters,
        config=config.training,
        commits_applied=state.core.commits_applied,
        commits_rejected=commits_rejected,
        spec=state.spec,
        buffer_spec=state.core.buffer_spec,
        uptime_seconds=uptime_seconds,
        last_evaluation=last_evaluation,
        learning_rate=state.learning_rate,
        gradient_noise=state.core.noise.estimate,
        layout=layout,
        workers=state.registry.listing(config.num_shards),
        lease_ttl_seconds=state.registry.lease_ttl,
        replication=replication,
        data_plane=data_plane,
        versions=versions.THIS,
        memory_budget_bytes=state.memory.bytes or 0,
        rule_state_bytes=state.rule_state_bytes,
        recent=state.registry.recent_commits(),
        gem_state=state.gem_state,
        worker_state_bytes=state.worker_state_bytes,
        shared_rule_state_bytes=state.shared_rule_state_bytes,
        restored=state.restored,
        job=state.job,
        rounds=state.rounds(),
    )
