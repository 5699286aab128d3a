"""Replication as a layer the server is composed with (DESIGN §3d).

`layer()` is the one name the server calls: with one replica the port's null object, with more a
`Replicated` layer around this process's `Replica`. Either is what the service asks
(`gemps_server.replicas.Replicas`: may I answer, when may I acknowledge, what is my status) and
one part of the server's lifecycle: started once the gRPC door has its port (others reach this
replica there), stopped first (the replica resigns, so a backup takes over at once). What else a
replica needs of the server is wired here, not in app.py: the data-plane ticket key it shares
with the service, its metrics collector, the epoch each checkpoint records, and the restored
checkpoint's (epoch, version) its election reads. A backup's replayed commits reach the checkpoint
schedule as a primary's do: through the applier, which tells it the version after each operation
(ParameterServer._applier_ran).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gemps_server.checkpoint_files import Checkpoint
from gemps_server.checkpoint_writer import Checkpointer
from gemps_server.config import ServerConfig
from gemps_server.domain.applier import Applier
from gemps_server.domain.state import ServerState
from gemps_server.listening import hostport, listening
from gemps_server.metrics import ServerMetrics
from gemps_server.replicas import Done, NoReplicas, Replicas
from gemps_server.replication.epoch_record import EpochRecord
from gemps_server.replication.metrics import ReplicationCollector
from gemps_server.replication.recovery import Held, replica_names
from gemps_server.replication.status import ReplicationStatus
from gemps_server.security import Tickets

# The replica, its election, its credential and etcd's client (cryptography, requests, etcd3gw: a
# fifth of a server's start-up) are imported by a server with replicas only.
if TYPE_CHECKING:
    from gemps_server.replication.election import Election

log = logging.getLogger("gemps.server")


class ReplicationLayer(Replicas, Protocol):
    """What the server composes: the service's port, and a part of the server's lifecycle."""

    @property
    def port(self) -> int:
        """The replication listener's port once started (0: none)."""
        ...

    async def start(self, grpc_port: int, restored: Checkpoint | None) -> None:
        """Join the partition's replicas, reachable at `grpc_port`, from the checkpoint `restored`."""
        ...

    async def stop(self, grace: float) -> None:
        """Leave them (a primary resigns first)."""
        ...


def layer(
    config: ServerConfig,
    state: ServerState,
    applier: Applier,
    tickets: Tickets,
    metrics: ServerMetrics,
    checkpointer: Checkpointer | None,
) -> ReplicationLayer:
    """This process's replication: none with `--replicas 1`, else a replica of its partition."""
    if config.replicas == 1:
        return Unreplicated()
    replicated = Replicated(config, state, applier, tickets, checkpointer)
    refusals = replicated.replica.refusals.counts
    ReplicationCollector(metrics.registry, replicated.status, replicated.waiting_for, refusals)
    return replicated


class Unreplicated(NoReplicas):
    """One replica: the port's null object, with nothing to start or stop."""

    port = 0

    async def start(self, grpc_port: int, restored: Checkpoint | None) -> None:
        return None

    async def stop(self, grace: float) -> None:
        return None


class Replicated:
    """A replicated partition's replica (its role decided by etcd once started), composed with
    the server: `tickets` is the service's (one data-plane key for every replica of the partition:
    a backup adopts its primary's)."""

    def __init__(
        self,
        config: ServerConfig,
        state: ServerState,
        applier: Applier,
        tickets: Tickets,
        checkpointer: Checkpointer | None,
    ) -> None:
        self._config = config
        self._state = state
        self._restored_epoch = 0  # the epoch of the checkpoint restored at start
        self._election: Election | None = None
        from gemps_server.replication.credentials import credential
        from gemps_server.replication.handshake import Handshake
        from gemps_server.replication.replica import Replica

        # The replicas prove themselves to each other with the job's credential (handshake.py).
        handshake = Handshake(credential(config), config.partition, config.replicas)
        self.replica = Replica(
            state, applier, config.replicas, config.replica_timeout, handshake, tickets, config.in_sync_floor
        )
        self.port = 0
        # A backup checkpoints too (a job whose every replica restarts resumes from the newest
        # state any of them saw): its replayed commits go through the commit core, whose hook
        # the checkpoint schedule is; each checkpoint records the epoch its state follows.
        if checkpointer is not None:
            checkpointer.epoch = self._held_epoch

    # -- the port (gemps_server.replicas.Replicas) ----------------------------------------------

    def require_primary(self) -> None:
        self.replica.require_primary()

    def status(self) -> ReplicationStatus:
        status = self.replica.status()
        waiting = self._election.unavailable.reason if self._election is not None else ""
        return dataclasses.replace(status, unavailable=waiting) if waiting else status

    def when_replicated(self, position: int, done: Done) -> None:
        self.replica.when_replicated(position, done)

    def waiting_for(self) -> tuple[str, ...]:
        """The replicas this one waits for before a primary may be chosen (etcd holds no in-sync
        list: a fresh job, or etcd lost its data); () when it waits for none."""
        return self._election.unavailable.missing if self._election is not None else ()

    def _held_epoch(self) -> int:
        return self.replica.held_epoch or self._restored_epoch

    def _held(self) -> Held:
        """(epoch, version) of the state this replica holds, read so that a seed landing between
        the two reads cannot pair a new epoch with the old state's version."""
        while True:
            epoch = self._held_epoch()
            version = self._state.core.version
            if self._held_epoch() == epoch:
                return epoch, version

    # -- the lifecycle part ----------------------------------------------------------------------

    async def start(self, grpc_port: int, restored: Checkpoint | None) -> None:
        """Listen for backups, then take part in the election (with the restored checkpoint's
        (epoch, version): the replica holding the newest state takes over a job restarted whole)."""
        from gemps_server.replication.election import Election, Member
        from gemps_server.replication.etcd_client import EtcdAccess, check_access, lease_ttl
        from gemps_server.replication.handshake import member_name
        from gemps_server.replication.listener import listen
        from gemps_server.replication.replica import Replica

        config = self._config
        bound: list[socket.socket] = []

        def bind() -> int:
            bound.append(listen(config.host, config.replication_port))
            return int(bound[0].getsockname()[1])

        self.port = listening("replication", config.host, config.replication_port, bind)
        try:
            host = advertised_host(config)
            me = Member(
                member_name(config.partition, config.replica),
                Replica.incarnation(),
                hostport(host, grpc_port),
                hostport(host, self.port),
            )
            prefix = f"/gemps/{config.job}/partition/{config.partition}"
            at = (restored.epoch, restored.version) if restored is not None else (0, 0)
            self._restored_epoch = at[0]
            if not config.checkpoint_dir:
                log.warning(
                    "%s: no --checkpoint-dir: the highest epoch this replica has seen is kept in memory only "
                    "(a restarted replica holds nothing then; the others' records keep epochs from repeating)",
                    me.name,
                )
            access = EtcdAccess.of(config)  # refused credentials: a start-up error naming the option
            lease = lease_ttl(config.replica_lease)  # refused at start where etcd grants no lease that short
            timeout = config.replica_lease / 3
            await asyncio.to_thread(check_access, config.etcd, access, f"{prefix}/primary", timeout, lease)
            election = Election(
                config.etcd,
                prefix,
                me,
                lease_seconds=config.replica_lease,
                restored=at,
                replicas=replica_names(config.partition, config.replicas),
                record=EpochRecord(Path(config.checkpoint_dir) if config.checkpoint_dir else None),
                held=self._held,
                access=access,
            )
            self._election = election
            self.replica.start(election, bound[0])
        except BaseException:
            bound[0].close()
            raise

    async def stop(self, grace: float) -> None:
        """Step down (the lease is given back, so a backup takes over without waiting for it)."""
        await asyncio.to_thread(self.replica.stop)


def advertised_host(config: ServerConfig) -> str:
    """The host others reach this process at: --advertise-host, else --host unless it listens on
    every address (then this machine's name)."""
    if config.advertise_host:
        return config.advertise_host
    return socket.gethostname() if config.host in ("", "0.0.0.0", "::") else config.host
