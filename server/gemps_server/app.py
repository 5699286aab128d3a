"""Server lifecycle: build the grpc.aio server, serve, and shut down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import disable_created_metrics, start_http_server

from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server import logs, supervision
from gemps_server.admission import AdmissionInterceptor
from gemps_server.allocator import TRIM_INTERVAL_SECONDS, one_arena, trim, tune_for
from gemps_server.checkpoint_writer import Checkpointer
from gemps_server.config import ServerConfig
from gemps_server.descriptors import connection_budget, raise_open_file_limit
from gemps_server.domain.applier import Applier
from gemps_server.domain.records import PartitionOf
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.logs import event
from gemps_server.metrics import ServerMetrics, exposed
from gemps_server.replication.election import Election, Member
from gemps_server.replication.metrics import ReplicationCollector
from gemps_server.replication.replica import Replica, listen
from gemps_server.security import Tickets, exposure_warnings, server_credentials
from gemps_server.service import ParameterService
from gemps_server.wire.data_plane import DataPlaneServer
from gemps_server.wire.grpc_servicer import GempsServicer, add_to_server
from gemps_server.wire.health import FAREWELL_SECONDS, HealthServicer
from gemps_server.wire.streams import Pace

log = logging.getLogger("gemps.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
# Lease checks run this often relative to the TTL, so eviction lags the TTL by at most a quarter.
LEASE_CHECKS_PER_TTL = 4
# Exit status when the final checkpoint failed and acknowledged commits were lost (2: cannot start).
EXIT_CHECKPOINT_LOST = 3


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ParameterServer:
    """One gemps server: `await start()`, then `await wait_closed()` or `await stop()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.state = ServerState(
            config.training,
            WorkerRegistry(config.max_workers, config.lease_ttl),
            gem_kernel=config.gem_kernel,
            partition=PartitionOf(config.partition, config.partitions),
            max_parameters=config.max_parameters,
            noise_window=config.noise_window,
        )
        self.applier = Applier(observer=lambda timing: self.metrics.applier_ran(timing.run_seconds))
        self._observe_state()
        self.checkpointer = (
            Checkpointer(config, self.state, self.applier, self.metrics) if config.checkpoint_dir else None
        )
        # Data-plane tickets: one key for every replica of the partition (a backup adopts its primary's).
        tickets = Tickets()
        # A replicated partition's replica (its role decided by etcd, once started); None: no replicas.
        self.replica = (
            Replica(
                self.state,
                self.applier,
                config.replicas,
                config.replica_timeout,
                config.token(),
                tickets,
                on_applied=self._replayed,
            )
            if config.replicas > 1
            else None
        )
        self.service = ParameterService(
            config,
            self.state,
            self.applier,
            self.metrics,
            on_committed=self.checkpointer.committed if self.checkpointer is not None else None,
            replicas=self.replica,
            tickets=tickets,
        )
        if self.replica is not None:
            ReplicationCollector(self.metrics.registry, self.replica.status)
            if self.checkpointer is not None:
                replica = self.replica
                self.checkpointer.epoch = lambda: replica.epoch
        self._restored = (0, 0)  # the (epoch, version) of the checkpoint restored at start
        self.servicer = GempsServicer(
            self.service,
            self.metrics,
            config.max_streamed_payloads,
            Pace(config.stream_idle_timeout, config.min_stream_bytes_per_second),
            reply_budget_bytes=config.max_reply_mb * 1024 * 1024,
        )
        # Its Watch streams are bounded, and end at shutdown (health.py).
        self.health = HealthServicer(
            config.max_watches, config.max_watches_per_connection, on_refused=self.metrics.refusal
        )
        self.admission: AdmissionInterceptor | None = (
            None  # the token and the budgets of calls in progress, once started
        )
        self.data_plane = DataPlaneServer(config, self.service, self.metrics) if config.data_plane_on else None
        self.port = 0
        self.data_port = 0  # bound once started (0: the data plane is off)
        self.replication_port = 0  # bound once started (0: no replicas)
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_server: object | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._trim_task: asyncio.Task[None] | None = None

    def _replayed(self, version: int) -> None:
        self.service.replayed(version)

    async def start(self) -> int:
        """Bind every port and serve; OSError (a port in use, an unusable checkpoint directory or
        one another server holds) or ValueError (a bad key file) when it cannot, with nothing
        left held."""
        try:
            return await self._start()
        except BaseException:
            self._abandon()
            raise

    async def _start(self) -> int:
        config = self.config
        if self.checkpointer is not None:
            restored = self.checkpointer.restore()  # before serving: workers register against the restored state
            if restored is not None:
                self._restored = (restored.epoch, restored.version)
            tune_for(4 * self.state.num_parameters)  # see allocator.py
        token = config.token()
        server = self._grpc_server(token)
        self.port = self._bind(server, token)
        self.applier.start()
        self.service.attach_loop(asyncio.get_running_loop())
        if self.data_plane is not None:  # before gRPC serves: every registration can announce it
            self.data_port = _listening("data plane", config.host, config.data_port, self.data_plane.start)
            self.service.data_plane_port = self.data_port
            self.service.data_plane_local = self.data_plane.local_socket
        self._start_metrics()
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._lease_task = asyncio.create_task(self._expire_leases(), name="gemps-leases")
        self._trim_task = asyncio.create_task(self._trim_heap(), name="gemps-heap-trim")
        if self.checkpointer is not None:
            self.checkpointer.start()
        self._start_replica()
        if self.config.port_file:
            # Written last, via a rename, so a reader never sees a partial file.
            tmp = Path(self.config.port_file + ".tmp")
            tmp.write_text(f"{self.port}\n{self.metrics_port if self.config.metrics_port >= 0 else -1}\n")
            tmp.replace(self.config.port_file)
        event(
            log,
            "serving",
            address=_hostport(self.config.host, self.port),
            data_port=self.data_port or None,
            **self.config.training.as_dict(),
            metrics_port=self.metrics_port if self.metrics_port else None,
            tls="mutual" if config.tls_client_ca else config.tls,
            auth="token" if token else None,
            version=self.state.version,
            checkpoint_dir=config.checkpoint_dir or None,
            partition=f"{config.partition} of {config.partitions}" if config.partitions > 1 else None,
        )
        return self.port

    def _start_replica(self) -> None:
        """Join the partition's replicas: listen for backups, then take part in the election."""
        if self.replica is None:
            return
        config = self.config
        bound: list[socket.socket] = []

        def bind() -> int:
            bound.append(listen(config.host, config.replication_port))
            return int(bound[0].getsockname()[1])

        self.replication_port = _listening("replication", config.host, config.replication_port, bind)
        host = advertised_host(config)
        me = Member(
            f"partition-{config.partition}-replica-{config.replica}",
            Replica.incarnation(),
            _hostport(host, self.port),
            _hostport(host, self.replication_port),
        )
        prefix = f"/gemps/{config.job}/partition/{config.partition}"
        election = Election(config.etcd, prefix, me, lease_seconds=config.replica_lease, restored=self._restored)
        self.replica.start(election, bound[0])

    def _abandon(self) -> None:
        """After a failed start: let go of what was taken (ports, threads, the checkpoint
        directory), so the process can exit or, in a test, start another server."""
        if self.data_plane is not None and self.data_port:
            self.data_plane.stop(0.0)
        if self.replica is not None:
            self.replica.stop()
        self.applier.stop()  # nothing was queued: its thread (if started) just ends
        if self._metrics_server is not None:
            self._metrics_server.shutdown()  # type: ignore[attr-defined]
            self._metrics_server.server_close()  # type: ignore[attr-defined]
        if self.checkpointer is not None:
            self.checkpointer.close()

    def _grpc_server(self, token: str) -> grpc.aio.Server:
        """The gRPC server with its limits (memory before trust: DESIGN §3b), this server's
        servicer, health and reflection; not yet bound or started."""
        config = self.config
        # In total: at most max_concurrent_rpcs requests being received, each of at most `limit`
        # bytes, plus max_unauthenticated_rpcs health checks (more calls are refused before a byte
        # of theirs is read).
        self.admission = AdmissionInterceptor(
            token, config.max_concurrent_rpcs, config.max_unauthenticated_rpcs, on_refused=self.metrics.refusal
        )
        limit = config.max_message_bytes
        # Connections within the open-file budget (descriptors.py); those that never finish their
        # handshake or sit without an RPC are closed, so idle ones cannot hold every place.
        connections = connection_budget(config.max_connections, raise_open_file_limit())
        if connections < config.max_connections:
            event(log, "connections capped", level=logging.WARNING, max_connections=connections)
        server = grpc.aio.server(
            interceptors=[self.admission],
            options=[
                # One server per address: gRPC sets SO_REUSEPORT by default, and a second server on
                # a port already served then shared its connections with the first (issue 28).
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", limit),
                # Replies are as large as θ needs (protobuf's 2 GiB at most); what they hold while
                # unread is bounded by the reply budget.
                ("grpc.max_send_message_length", 2**31 - 1),
                # No BDP probing: flow-control windows stay at gRPC's default instead of growing to
                # megabytes per stream, so large payloads wait in the clients, not in this process
                # (1M parameters, 8 clients: 44 MB less peak memory, throughput within noise).
                ("grpc.http2.bdp_probe", 0),
                ("grpc.max_allowed_incoming_connections", connections),
                ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout * 1000)),
                ("grpc.max_connection_idle_ms", int(config.connection_idle_timeout * 1000)),
                # What one connection can hold: its RPCs at once, each a request of at most
                # max_message_bytes; replies wait in the servicer's reply budget.
                ("grpc.max_concurrent_streams", config.max_streams_per_connection),
                # A reply sits in gRPC until its client reads it, and grpc.aio cannot cancel one
                # call from the server: closing the connection is what frees it. So none lives
                # longer than age + grace (honest clients reconnect on GOAWAY).
                ("grpc.max_connection_age_ms", int(config.max_connection_age * 1000)),
                ("grpc.max_connection_age_grace_ms", int(config.connection_age_grace * 1000)),
                # The SDK pings every 2 s while a call waits (to notice a dead server in seconds):
                # allowed, without data in between, at that pace; faster pings still earn strikes.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ],
        )
        add_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        return server

    def _bind(self, server: grpc.aio.Server, token: str) -> int:
        """Bind the configured address (TLS when configured); the port bound."""
        config = self.config
        address = _hostport(config.host, config.port)
        if config.port:  # gRPC would log a failure of its own on stderr: ask the kernel first
            _listening("gRPC", config.host, config.port, lambda: _probe(config.host, config.port))
        try:
            if config.tls:
                credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError:  # grpcio's "Failed to bind to address"
            port = 0
        if port == 0:
            raise OSError(f"gRPC: cannot listen on {address}")
        for warning in exposure_warnings(config.host, tls=config.tls, token=bool(token)):
            event(log, "insecure listener", level=logging.WARNING, warning=warning)
        return port

    async def stop(self, grace: float | None = None) -> bool:
        """Shut down gracefully: report NOT_SERVING, refuse new RPCs and give in-flight ones up to
        `grace` seconds (default: the config's shutdown_grace), apply every queued commit, write the
        final checkpoint, stop. False when checkpoints are on and the final one failed: commits
        were acknowledged that no checkpoint holds (logged with the versions lost)."""
        grace = self.config.shutdown_grace if grace is None else grace
        if self.replica is not None:  # resigns first: a backup takes over without waiting for the lease
            await asyncio.to_thread(self.replica.stop)
        await self.health.enter_graceful_shutdown()
        for task in (self._lease_task, self._trim_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Both doors close together: in-flight requests on either get `grace` to be answered.
        closing: list[Awaitable[None]] = []
        if self.data_plane is not None:
            closing.append(asyncio.to_thread(self.data_plane.stop, grace))
        if self._server is not None:
            closing.append(self._stop_grpc(self._server, grace))
        await asyncio.gather(*closing)
        if self.checkpointer is not None:
            await self.checkpointer.stop_schedule()
        await asyncio.to_thread(self.applier.stop)  # runs what is still queued
        durable = True
        if self.checkpointer is not None:
            await self.checkpointer.write_final()
            durable = self.checkpointer.last_version == self.state.version or not self.state.initialized
        if self._metrics_server is not None:
            self._metrics_server.shutdown()  # type: ignore[attr-defined]
            self._metrics_server.server_close()  # type: ignore[attr-defined]
        if self.checkpointer is not None:
            self.checkpointer.close()
        if not durable:
            assert self.checkpointer is not None
            newest = self.checkpointer.last_version
            event(
                log,
                "stopped without a final checkpoint",
                level=logging.ERROR,
                version=self.state.version,
                newest_checkpoint=newest,
                lost=f"{(newest or 0) + 1}..{self.state.version}",
            )
            return False
        event(log, "stopped", version=self.state.version, active=len(self.state.registry))
        return True

    async def _stop_grpc(self, server: grpc.aio.Server, grace: float) -> None:
        """Calls in flight get up to `grace` seconds; new ones are refused UNAVAILABLE meanwhile
        (health checks still answer, NOT_SERVING). Once no call that carries work is left, Watch
        streams (told NOT_SERVING) get FAREWELL_SECONDS to end, then gRPC stops, cancelling what
        remains: a Watch whose client never reads held the shutdown for the whole grace before
        (issue 28, item 4). One call to server.stop(): grpc.aio's shutdown must not run twice at
        once (a second one can cancel calls on a server the first has just destroyed)."""
        assert self.admission is not None
        self.admission.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.admission.calls.idle(), grace)
        left = max(0.0, deadline - loop.time())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.health.watches.none(), min(FAREWELL_SECONDS, left))
        await server.stop(0)

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _start_metrics(self) -> None:
        if self.config.metrics_port < 0:
            return
        host = self.config.metrics_host or self.config.host
        labels = {"partition": str(self.config.partition)} if self.config.partitions > 1 else {}
        if self.config.replicas > 1:
            labels["replica"] = str(self.config.replica)
        registry = exposed(self.metrics.registry, labels)

        def start() -> int:
            server, _thread = start_http_server(self.config.metrics_port, addr=host, registry=registry)
            self._metrics_server = server
            return int(server.server_port)

        self.metrics_port = _listening("metrics", host, self.config.metrics_port, start)

    def _observe_state(self) -> None:
        state = self.state
        self.metrics.describe_server(self.config.training)

        def rule_state_bytes() -> int:
            # Read at scrape time from another thread: a stale-by-one value is fine for a gauge.
            rule = state.rule
            vectors = rule.vectors_per_worker if rule is not None else 0
            return vectors * state.num_parameters * 4 * len(state.registry)

        self.metrics.observe(
            version=lambda: state.version,
            parameters=lambda: state.num_parameters,
            rule_state_bytes=rule_state_bytes,
            active_workers=lambda: len(state.registry),
            queue_depth=lambda: self.applier.depth,
            gradient_noise=lambda: state.noise.estimate,
        )

    async def _trim_heap(self) -> None:
        while True:
            await asyncio.sleep(TRIM_INTERVAL_SECONDS)
            await asyncio.to_thread(trim)  # off the event loop: it walks the heap

    async def _expire_leases(self) -> None:
        period = self.config.lease_ttl / LEASE_CHECKS_PER_TTL
        while True:
            await asyncio.sleep(period)
            await self.service.evict_expired()


def advertised_host(config: ServerConfig) -> str:
    """The host others reach this process at: --advertise-host, else --host unless it listens on
    every address (then this machine's name)."""
    if config.advertise_host:
        return config.advertise_host
    return socket.gethostname() if config.host in ("", "0.0.0.0", "::") else config.host


def _listening(what: str, host: str, port: int, start: Callable[[], int]) -> int:
    """`start()` (which binds `host`:`port`), its bound port; its OSError said in one line
    that names the listener and the address."""
    try:
        return start()
    except OSError as error:
        hint = " (is another server listening there?)" if error.errno == errno.EADDRINUSE else ""
        reason = error.strerror or str(error)
        raise OSError(f"{what}: cannot listen on {_hostport(host, port)}: {reason}{hint}") from None


def _probe(host: str, port: int) -> int:
    """Bind `host`:`port` as gRPC does (SO_REUSEADDR, which a listener's port does not share), then
    let it go; OSError when it cannot be bound, e.g. another server listens there."""
    family, kind, protocol, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
    return port


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


async def serve(config: ServerConfig, ready: threading.Event | None = None) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully.

    Owns the process's logging (the configured level and format: text or JSON lines) and its
    prometheus_client settings.
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
    server = ParameterServer(config)
    try:
        await server.start()
    except (OSError, ValueError) as error:  # a port in use, an unusable checkpoint dir or key file
        event(log, "cannot start", level=logging.ERROR, error=f"{type(error).__name__}: {error}")
        raise SystemExit(2) from None
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on the main thread
            loop.add_signal_handler(sig, stop.set)
    closed = asyncio.create_task(server.wait_closed())
    stopping = asyncio.create_task(stop.wait())
    watching = asyncio.create_task(_watch_supervisor(config.supervisor_pid, stop))
    await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    event(log, "shutting down", grace_seconds=config.shutdown_grace)
    durable = await server.stop()
    closed.cancel()
    stopping.cancel()
    if not durable:  # acknowledged commits are in no checkpoint: say so with the exit status too
        raise SystemExit(EXIT_CHECKPOINT_LOST)
