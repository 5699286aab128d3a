"""The gRPC door: the grpc.aio server with its limits, bound, serving, and closed with a grace.

One part of the server's lifecycle (lifecycle.py): `start()` builds the server (its options are
memory before trust: DESIGN §3b), binds the configured address and serves the servicer, health and
reflection; `stop(grace)` lets calls in flight finish (see `stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.admission import AdmissionInterceptor
from gemps_server.config import ServerConfig
from gemps_server.descriptors import connection_budget, raise_open_file_limit
from gemps_server.listening import hostport, listening
from gemps_server.logs import event
from gemps_server.metrics import ServerMetrics
from gemps_server.security import exposure_warnings, revocations, server_credentials
from gemps_server.wire.grpc_servicer import GempsServicer, add_to_server
from gemps_server.wire.health import FAREWELL_SECONDS, HealthServicer

log = logging.getLogger("gemps.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name


class GrpcDoor:
    """The gRPC port: `port` once started."""

    name = "gRPC"

    def __init__(
        self, config: ServerConfig, servicer: GempsServicer, health: HealthServicer, metrics: ServerMetrics
    ) -> None:
        self._config = config
        self._servicer = servicer
        self._health = health
        self._metrics = metrics
        self.port = 0
        self.authenticates = False  # whether calls must carry the token, once started
        # The token and the budgets of calls in progress, once started.
        self.admission: AdmissionInterceptor | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        token = self._config.token()
        self.authenticates = bool(token)
        server = self._grpc_server(token)
        self.port = self._bind(server, token)
        await server.start()
        self._server = server

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _grpc_server(self, token: str) -> grpc.aio.Server:
        """The gRPC server with its limits (memory before trust: DESIGN §3b), this server's
        servicer, health and reflection; not yet bound or started."""
        config = self._config
        # In total: at most max_concurrent_rpcs requests being received, each of at most `limit`
        # bytes, plus max_unauthenticated_rpcs health checks (more calls are refused before a byte
        # of theirs is read).
        self.admission = AdmissionInterceptor(
            token,
            config.max_concurrent_rpcs,
            config.max_unauthenticated_rpcs,
            on_refused=self._metrics.refusal,
            revocations=revocations(config.tls_crl, config.tls_client_ca),
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
        add_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        return server

    def _bind(self, server: grpc.aio.Server, token: str) -> int:
        """Bind the configured address (TLS when configured); the port bound."""
        config = self._config
        address = hostport(config.host, config.port)
        if config.port:  # gRPC would log a failure of its own on stderr: ask the kernel first
            listening("gRPC", config.host, config.port, lambda: _probe(config.host, config.port))
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

    async def stop(self, grace: float) -> None:
        """Calls in flight get up to `grace` seconds; new ones are refused UNAVAILABLE meanwhile
        (health checks still answer, NOT_SERVING). Once no call that carries work is left, Watch
        streams (told NOT_SERVING) get FAREWELL_SECONDS to end, then gRPC stops, cancelling what
        remains: a Watch whose client never reads held the shutdown for the whole grace before
        (issue 28, item 4). One call to server.stop(): grpc.aio's shutdown must not run twice at
        once (a second one can cancel calls on a server the first has just destroyed)."""
        server, admission = self._server, self.admission
        if server is None or admission is None:
            return
        admission.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(admission.calls.idle(), grace)
        left = max(0.0, deadline - loop.time())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._health.watches.none(), min(FAREWELL_SECONDS, left))
        await server.stop(0)


def _probe(host: str, port: int) -> int:
    """Bind `host`:`port` as gRPC does (SO_REUSEADDR, which a listener's port does not share), then
    let it go; OSError when it cannot be bound, e.g. another server listens there."""
    family, kind, protocol, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
    return port
