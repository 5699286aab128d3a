"""The data plane's listener (DESIGN §3c): a TCP port beside gRPC for Commit and Pull with θ's
raw bytes, one blocking thread per connection (measured: 2-3x an asyncio server here; see
scripts/transport_candidates.py), the protocol in data_plane_calls.py.

Memory before trust (DESIGN §3b): at most --max-data-connections connections (more are refused
on arrival), each with one request in flight and nothing read before its HELLO's ticket is
checked; θ-sized buffers only from a pool of --data-plane-buffers; handshake, idle and stall
timeouts. TLS with the gRPC port's certificates (client certificates required when
--tls-client-ca is set). Every connection closed by a guard is counted
(gemps_data_plane_refusals_total{reason}).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from pathlib import Path

from gemps_proto.dataplane import Op, frame_start
from gemps_proto.reasons import Reason
from gemps_server.config import ServerConfig
from gemps_server.domain.errors import ResourceExhausted
from gemps_server.logs import Throttle, event
from gemps_server.metrics import ServerMetrics
from gemps_server.service import ParameterService
from gemps_server.wire.data_plane_calls import Connection, Limits, error_header
from gemps_server.wire.data_plane_io import Channel
from gemps_server.wire.stream_buffers import ThreadBufferPool

log = logging.getLogger("gemps.server")

# Connections a listener lets wait for accept() (the kernel's queue, not this process's memory).
BACKLOG = 128
# How long stop() waits for a connection's thread to end after its socket was shut down.
JOIN_SECONDS = 5.0


def tls_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """The gRPC port's TLS, for a plain socket: the same chain and key, and with `client_ca`,
    client certificates signed by it required (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(cafile=str(Path(client_ca)))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class DataPlaneServer:
    """`start()` binds and accepts on a thread of its own; `stop(grace)` ends it gracefully."""

    def __init__(self, config: ServerConfig, service: ParameterService, metrics: ServerMetrics) -> None:
        self._config = config
        self._service = service
        self._metrics = metrics
        self._limits = Limits(
            max_header_bytes=config.max_message_bytes,
            handshake_timeout=config.handshake_timeout,
            idle_timeout=config.connection_idle_timeout,
            stream_timeout=config.stream_idle_timeout,
        )
        self._pool = ThreadBufferPool(config.data_plane_buffers)
        self._tls = tls_context(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls else None
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._connections: dict[Connection, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._refusal_log = Throttle(interval=1.0)
        self.port = 0

    def start(self) -> int:
        """Bind --host:--data-port (0: a free port) and start accepting; the port bound."""
        family = socket.AF_INET6 if ":" in self._config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self._config.host, self._config.data_port))
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="gemps-data-accept", daemon=True)
        self._acceptor.start()
        return self.port

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                sock, _address = self._listener.accept()
            except OSError:  # the listener was shut down (stop), or a connection died in the queue
                if self._closing.is_set():
                    return
                continue
            accepted_at = time.monotonic()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = len(self._connections) >= self._config.max_data_connections
            if full:
                self._refuse_connection(sock)
                continue
            self._open(sock, accepted_at)

    def _open(self, sock: socket.socket, accepted_at: float) -> None:
        connection = Connection(Channel(sock), self._service, self._metrics, self._limits, self._pool, accepted_at)
        thread = threading.Thread(target=self._serve, args=(connection,), name="gemps-data-connection", daemon=True)
        with self._lock:
            self._connections[connection] = thread
        self._metrics.data_plane_connections.inc()
        thread.start()

    def _serve(self, connection: Connection) -> None:
        try:
            if self._tls is not None and not self._handshake(connection):
                return
            connection.serve()
        except Exception as error:  # a bug must not take the listener down with it
            event(log, "data-plane connection failed", level=logging.ERROR, error=f"{type(error).__name__}: {error}")
        finally:
            connection.channel.close()
            with self._lock:
                self._connections.pop(connection, None)
            self._metrics.data_plane_connections.dec()

    def _handshake(self, connection: Connection) -> bool:
        """TLS on the accepted socket within --handshake-timeout; False (counted) if it failed."""
        assert self._tls is not None
        channel = connection.channel
        channel.sock.settimeout(self._config.handshake_timeout)
        try:
            channel.sock = self._tls.wrap_socket(channel.sock, server_side=True)
        except TimeoutError:
            self._refused("handshake_timeout")
            return False
        except (ssl.SSLError, OSError) as error:
            self._refused("tls", detail=str(error))
            return False
        return True

    def _refuse_connection(self, sock: socket.socket) -> None:
        """Past --max-data-connections: say so if it fits in the socket's buffer now (plain TCP
        only: under TLS that would cost a handshake), then close."""
        if self._tls is None:
            error = ResourceExhausted(
                f"more than {self._config.max_data_connections} data-plane connections (--max-data-connections)",
                Reason.TOO_LARGE,
            )
            try:
                sock.setblocking(False)
                sock.send(frame_start(Op.ERROR, error_header(error)))
            except OSError:
                pass
        sock.close()
        self._refused("too_many_connections")

    def _refused(self, reason: str, detail: str = "") -> None:
        self._metrics.data_plane_refused(reason)
        suppressed = self._refusal_log.allow(reason)
        if suppressed is not None:
            event(log, "data-plane connection refused", reason=reason, detail=detail or None, suppressed=suppressed)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def stop(self, grace: float) -> None:
        """Stop accepting; connections waiting for a request are closed now, those in the middle of
        one get `grace` seconds to send its reply, then every socket is shut down. Runs before
        the final checkpoint: a reply sent here is for a commit the state already applied."""
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (Linux)
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(JOIN_SECONDS)
        with self._lock:
            connections = dict(self._connections)
        for connection in connections:
            connection.stop_when_idle()
        deadline = time.monotonic() + grace
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        for connection, thread in connections.items():
            if thread.is_alive():
                connection.channel.shutdown()
                thread.join(JOIN_SECONDS)
