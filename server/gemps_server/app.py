"""Server lifecycle: compose the server's parts, serve, and shut down gracefully.

`ParameterServer` builds the domain, the service, the wires and the replication layer, and
declares once the order its parts start in (lifecycle.Stack): they stop in reverse, and a start
that fails unwinds what was started. `serve()` runs one until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio

# asyncio.to_thread imports this the first time it runs, which may be at shutdown (the data
# plane's stop): with every descriptor taken, that import failed (EMFILE), the stop with it, and
# the process exited 1 (issue 42, item 2). So it is imported now.
import concurrent.futures.thread  # noqa: F401
import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Mapping

from grpc_health.v1 import health_pb2
from prometheus_client import disable_created_metrics

from gemps_proto import versions
from gemps_server import logs, process_title, supervision
from gemps_server.allocator import TRIM_INTERVAL_SECONDS, one_arena, trim
from gemps_server.checkpoint_writer import Checkpointer
from gemps_server.config import ServerConfig
from gemps_server.config.limits import DEFAULT_MAX_PARAMETERS
from gemps_server.config_log import log_configuration
from gemps_server.descriptors import reserve
from gemps_server.domain.applier import Applier
from gemps_server.domain.records import PartitionOf
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.lifecycle import Stack, Step, Task, Together
from gemps_server.listening import hostport
from gemps_server.logs import event
from gemps_server.memory_budget import MemoryBudget
from gemps_server.memory_claims import MemoryClaims, folder_of
from gemps_server.metrics import ServerMetrics
from gemps_server.parts import (
    CheckpointDirectory,
    CheckpointSchedule,
    DataPlaneDoor,
    FinalCheckpoint,
    MetricsEndpoint,
    PortFile,
)
from gemps_server.replication.layer import layer
from gemps_server.security import Tickets, revocations
from gemps_server.service import ParameterService
from gemps_server.wire.data_plane import DataPlaneServer
from gemps_server.wire.grpc_server import SERVICE_NAME, GrpcDoor
from gemps_server.wire.grpc_servicer import GempsServicer
from gemps_server.wire.health import HealthServicer
from gemps_server.wire.streams import Pace
from gemps_server.wire.worker_certificates import WorkerCertificates

log = logging.getLogger("gemps.server")

# Lease checks run this often relative to the TTL, so eviction lags the TTL by at most a quarter,
# and at least every LEASE_CHECK_SECONDS: a superseded worker (domain/workers.py) goes in seconds.
LEASE_CHECKS_PER_TTL = 4
LEASE_CHECK_SECONDS = 1.0
# With --tls-crl, the certificates of this many registrations per --max-workers are kept (the
# local socket's connections answer for them: wire/worker_certificates.py).
REGISTRATIONS_KEPT = 4
# Exit status when the final checkpoint failed and acknowledged commits were lost (2: cannot start).
EXIT_CHECKPOINT_LOST = 3


class ParameterServer:
    """One gemps server: `await start()`, then `await wait_closed()` or `await stop()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        reserve()  # descriptors kept from the start for checkpoints and shutdown (descriptors.py)
        self.metrics = ServerMetrics()
        claims_folder = folder_of(config.memory_claims_dir)
        # Other jobs on this host see what this one may take (memory_claims.py); one supervisor's share.
        claims = MemoryClaims(claims_folder, group=config.supervisor_pid) if claims_folder is not None else None
        memory = MemoryBudget(config.memory_budget_mb, share=config.memory_share, claims=claims)
        # The server's settings by name: each rule reads its own (GEM its kernel, own step and state's form).
        runtime = RuleRuntime(**{field.name: getattr(config, field.name) for field in dataclasses.fields(config)})
        largest = runtime.form(config.training.rule).worker_state_bytes(config.max_parameters)
        if config.memory_budget_mb or config.max_parameters != DEFAULT_MAX_PARAMETERS:
            # A WARNING when they cannot all fit; with both defaults (2**28 values, no budget set)
            # it would fire on every machine: the bound is then set, and said, once θ's size is known.
            memory.check_at_start(config.max_workers, largest)
        self.state = ServerState(
            config.training,
            WorkerRegistry(config.max_workers, config.lease_ttl),
            rule_runtime=runtime,
            partition=PartitionOf(config.partition, config.partitions),
            max_parameters=config.max_parameters,
            noise_window=config.noise_window,
            memory=memory,
            compiled_core=config.compiled_core,
        )
        self.checkpointer: Checkpointer | None = None
        self.applier = Applier(observer=self._applier_ran)
        self._observe_state()
        self.checkpointer = (
            Checkpointer(config, self.state, self.applier, self.metrics) if config.checkpoint_dir else None
        )
        # Data-plane tickets: one key for every replica of the partition (a backup adopts its primary's).
        tickets = Tickets()
        # Who answers and when a commit is acknowledged: this process alone, or its partition's replicas.
        self.replication = layer(config, self.state, self.applier, tickets, self.metrics, self.checkpointer)
        self.service = ParameterService(
            config,
            self.state,
            self.applier,
            self.metrics,
            replicas=self.replication,
            tickets=tickets,
        )
        # With --tls-crl: the certificate each worker registered with (the local socket's: it has no TLS).
        revoked = revocations(config.tls_crl, config.tls_client_ca)
        certificates = WorkerCertificates(revoked, REGISTRATIONS_KEPT * config.max_workers) if revoked else None
        self.servicer = GempsServicer(
            self.service,
            self.metrics,
            config.max_streamed_payloads,
            Pace(config.stream_idle_timeout, config.min_stream_bytes_per_second),
            reply_budget_bytes=config.max_reply_mb * 1024 * 1024,
            certificates=certificates,
        )
        # Its Watch streams are bounded, and end at shutdown (health.py).
        self.health = HealthServicer(
            config.max_watches, config.max_watches_per_connection, on_refused=self.metrics.refusal
        )
        self.data_plane = (
            DataPlaneServer(config, self.service, self.metrics, certificates) if config.data_plane_on else None
        )
        self._grpc = GrpcDoor(config, self.servicer, self.health, self.metrics)
        self._metrics_endpoint = MetricsEndpoint(config, self.metrics)
        self._data_plane_door = DataPlaneDoor(config, self.data_plane, self.service) if self.data_plane else None
        checkpointer = self.checkpointer
        self._directory = CheckpointDirectory(checkpointer, self.state) if checkpointer is not None else None
        self._final = FinalCheckpoint(checkpointer, self.state) if checkpointer is not None else None
        # The server's parts in the order they start; they stop in reverse (resign first, then
        # NOT_SERVING, the tasks, both doors together with the grace, the checkpoint schedule, the
        # applier drained, the final checkpoint, the metrics endpoint, the checkpoint directory, then
        # this server's memory claim withdrawn).
        self._parts = Stack(
            [
                Step("memory claim", end=self._withdraw_claim) if claims is not None else None,
                self._directory,
                self._metrics_endpoint if config.metrics_port >= 0 else None,
                self._final,
                Step("applier", self._start_applier, self._drain_applier),
                CheckpointSchedule(checkpointer) if checkpointer is not None else None,
                Together("doors", [self._data_plane_door, self._grpc]),
                Task("gemps-leases", self._expire_leases),
                Task("gemps-heap-trim", self._trim_heap),
                Step("health", self._serving, self._not_serving),
                Step("replication", self._join_replicas, self.replication.stop),
                PortFile(config.port_file, self._announced_ports) if config.port_file else None,
            ]
        )

    # -- where it listens, once started ----------------------------------------------------------

    @property
    def port(self) -> int:
        return self._grpc.port

    @property
    def data_port(self) -> int:
        """0: the data plane is off."""
        return self._data_plane_door.port if self._data_plane_door is not None else 0

    @property
    def replication_port(self) -> int:
        """0: no replicas."""
        return self.replication.port

    @property
    def metrics_port(self) -> int:
        return self._metrics_endpoint.port

    def role(self) -> str:
        """PRIMARY, BACKUP or CANDIDATE in a replicated partition; "" without replicas."""
        status = self.replication.status()
        return status.role if status is not None else ""

    def _announced_ports(self) -> tuple[int, int]:
        return self.port, self.metrics_port if self.config.metrics_port >= 0 else -1

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind every port and serve; OSError (a port in use, an unusable checkpoint directory or
        one another server holds) or ValueError (a bad key file, a checkpoint of a newer format)
        when it cannot, with nothing left held."""
        await self._parts.start()
        config = self.config
        event(
            log,
            "serving",
            gemps_version=versions.SOFTWARE_VERSION,  # `version` is θ's, below
            protocol=versions.PROTOCOL_VERSION,
            address=hostport(config.host, self.port),
            data_port=self.data_port or None,
            **config.training.as_dict(),
            metrics_port=self.metrics_port if self.metrics_port else None,
            tls="mutual" if config.tls_client_ca else config.tls,
            auth="token" if self._grpc.authenticates else None,
            version=self.state.core.version,
            checkpoint_dir=config.checkpoint_dir or None,
            partition=f"{config.partition} of {config.partitions}" if config.partitions > 1 else None,
        )
        return self.port

    async def stop(self, grace: float | None = None) -> bool:
        """Shut down gracefully: report NOT_SERVING, refuse new RPCs and give in-flight ones up to
        `grace` seconds (default: the config's shutdown_grace), apply every queued commit, write the
        final checkpoint, stop. False when checkpoints are on and the final one failed: commits
        were acknowledged that no checkpoint holds (logged with the versions lost). A part that
        fails to stop (out of descriptors, say) is logged, the others stopped all the same: it
        changes nothing to the outcome, which is whether what was acknowledged is durable."""
        self.service.waits.stop()  # a pull held until θ moves is answered now, not at the end of the grace
        with contextlib.suppress(Exception):  # each part was stopped, its failure logged: durability decides
            await self._parts.stop(self.config.shutdown_grace if grace is None else grace)
        if self._final is not None and not self._final.durable:
            assert self.checkpointer is not None
            newest = self.checkpointer.last_version
            event(
                log,
                "stopped without a final checkpoint",
                level=logging.ERROR,
                version=self.state.core.version,
                newest_checkpoint=newest,
                lost=f"{(newest or 0) + 1}..{self.state.core.version}",
            )
            return False
        event(log, "stopped", version=self.state.core.version, active=len(self.state.registry))
        return True

    async def wait_closed(self) -> None:
        await self._grpc.wait_closed()

    # -- the parts that are a call or two ------------------------------------------------------------

    def _applier_ran(self, run_seconds: float, cpu_seconds: float) -> None:
        """After each operation on the applier (a commit, a backup's replay, an adoption...), on its
        thread: the applier's time counted, and the checkpoint schedule told the version reached
        (Checkpointer.committed: due once --checkpoint-every versions went by). The commit core
        carries out neither."""
        self.metrics.applier_ran(run_seconds, cpu_seconds)
        if self.checkpointer is not None:
            self.checkpointer.committed(self.state.core.version)

    async def _start_applier(self) -> None:
        self.applier.start()

    async def _drain_applier(self, grace: float) -> None:
        await asyncio.to_thread(self.applier.stop)  # runs what is still queued

    async def _withdraw_claim(self, grace: float) -> None:
        if self.state.memory.claims is not None:
            self.state.memory.claims.withdraw()

    async def _serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def _not_serving(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()

    async def _join_replicas(self) -> None:
        await self.replication.start(self.port, self._directory.restored if self._directory is not None else None)

    def _observe_state(self) -> None:
        state = self.state
        self.metrics.describe_server(self.config.training)

        self.metrics.observe(
            version=lambda: state.core.version,
            parameters=lambda: state.core.num_parameters,
            # Read at scrape time from another thread: a stale-by-one value is fine for a gauge.
            rule_state_bytes=lambda: state.rule_state_bytes,
            shared_rule_state_bytes=lambda: state.shared_rule_state_bytes,
            reply_copy_bytes=lambda: state.core.copies.nbytes,
            reply_copies_unkept=lambda: state.core.copies.unkept,
            active_workers=lambda: len(state.registry),
            queue_depth=lambda: self.applier.depth,
            gradient_noise=lambda: state.core.noise.estimate,
            workers=state.registry.listing,  # the stragglers' rankings
            rounds=state.rounds,
        )

    async def _trim_heap(self) -> None:
        while True:
            await asyncio.sleep(TRIM_INTERVAL_SECONDS)
            await asyncio.to_thread(trim)  # off the event loop: it walks the heap

    async def _expire_leases(self) -> None:
        period = min(self.config.lease_ttl / LEASE_CHECKS_PER_TTL, LEASE_CHECK_SECONDS)
        while True:
            await asyncio.sleep(period)
            await self.service.evict_expired()


def configure_logs(config: ServerConfig, origin: str = "") -> None:
    """The process's logging as the config says (level; text or JSON lines), each line's logger
    tagged with `origin` when given (several processes of one server sharing a terminal)."""
    logs.configure(config.log_level, config.log_format, origin=origin)


async def _watch_supervisor(pid: int, stop: asyncio.Event) -> None:
    """Set `stop` once process `pid` is no longer this one's parent (0: no supervisor)."""
    if not pid:
        return
    while supervision.parent_is(pid):
        await asyncio.sleep(supervision.CHECK_SECONDS)
    event(log, "supervisor gone", level=logging.WARNING, supervisor=pid)
    stop.set()


async def serve(
    config: ServerConfig, ready: threading.Event | None = None, origins: Mapping[str, str] | None = None
) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully.

    Owns the process's logging (the configured level and format: text or JSON lines) and its
    prometheus_client settings; logs the configuration once serving, with `origins` (option ->
    flag, environment or default) when the caller knows them.
    """
    origin = [f"partition {config.partition}"] if config.partitions > 1 else []
    origin += [f"replica {config.replica}"] if config.replicas > 1 else []
    configure_logs(config, " ".join(origin))
    # No `<name>_created` series next to every counter, histogram and summary: in the text format
    # Prometheus stores them as gauges of their own, doubling the server's series for nothing.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    one_arena()  # before the server's threads exist (allocator.py)
    if config.supervisor_pid:  # a partition: it dies with its supervisor (supervision.py)
        supervision.die_with_parent()
        if not supervision.parent_is(config.supervisor_pid):
            event(log, "cannot start", level=logging.ERROR, error=f"supervisor {config.supervisor_pid} is gone")
            raise SystemExit(2)
    # Handlers first: a supervisor may send SIGTERM the moment the port file appears, and the
    # default action would kill the server before it logs its configuration or stops gracefully.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on the main thread
            loop.add_signal_handler(sig, stop.set)
    try:
        server = ParameterServer(config)  # reads the TLS files and the CRL (the data plane's, the replicas')
        await server.start()
    except (OSError, ValueError) as error:  # a port in use, an unusable checkpoint dir, key file or CRL
        event(log, "cannot start", level=logging.ERROR, error=f"{type(error).__name__}: {error}")
        raise SystemExit(2) from None
    log_configuration(config, origins)  # once it serves: a server that cannot start says so in one line
    if ready is not None:
        ready.set()
    closed = asyncio.create_task(server.wait_closed())
    stopping = asyncio.create_task(stop.wait())
    watching = asyncio.create_task(_watch_supervisor(config.supervisor_pid, stop))
    titled = asyncio.create_task(process_title.keep(config, server.port, server.role))
    await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    titled.cancel()
    event(log, "shutting down", grace_seconds=config.shutdown_grace)
    durable = await server.stop()
    closed.cancel()
    stopping.cancel()
    if not durable:  # acknowledged commits are in no checkpoint: say so with the exit status too
        raise SystemExit(EXIT_CHECKPOINT_LOST)
