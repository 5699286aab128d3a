"""The data plane's listener (DESIGN §3c): a TCP port beside gRPC for Commit and Pull with θ's
raw bytes, every connection served by one thread with non-blocking sockets (data_plane_loop.py;
measured against a thread per connection in docs/PERFORMANCE.md), the protocol in
data_plane_calls.py. With --shared-memory on, also an abstract Unix socket with a random name
(`local_socket`, announced at Register): reachable only from this server's network namespace, so
only by clients on its host, which may attach shared memory there (shared_memory.py).

Memory before trust (DESIGN §3b): at most --max-data-connections connections (more are refused
on arrival), of which at most --max-unproven-data-connections have not yet proved a ticket (past
it, the oldest of those is closed for the newcomer), each with one request in flight and nothing
read before its HELLO's ticket is checked, within --data-plane-hello-timeout of accept; θ-sized
buffers only from the pools of --data-plane-buffers and --slow-upload-buffers
(data_plane_uploads.py); idle and stall timeouts. TLS with the gRPC port's certificates (client
certificates required when --tls-client-ca is set), its handshakes done off the loop's thread and
bounded per address (tls_handshakes.py). Every connection closed by a guard is counted
(gemps_data_plane_refusals_total{reason}).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import secrets
import socket
import threading
import time

from gemps_proto.data_plane_events import ErrorReply
from gemps_proto.data_plane_protocol import ServerConnection
from gemps_proto.reasons import Reason
from gemps_server.config import ServerConfig
from gemps_server.descriptors import exhausted, reserve
from gemps_server.domain.errors import ResourceExhausted
from gemps_server.logs import Throttle, event
from gemps_server.memory_budget import MIB
from gemps_server.metrics import ServerMetrics
from gemps_server.security import tls_context
from gemps_server.service import ParameterService
from gemps_server.wire.data_plane_calls import Connection, HandshakeStart, Limits
from gemps_server.wire.data_plane_io import Channel
from gemps_server.wire.data_plane_loop import Body, Loop, Parked, Task
from gemps_server.wire.data_plane_uploads import Lanes
from gemps_server.wire.refusal_budget import RefusalBudget
from gemps_server.wire.shared_memory_budget import SharedMemoryBudget
from gemps_server.wire.status_codes import error_header
from gemps_server.wire.streams import Pace
from gemps_server.wire.tls_handshakes import Handshakes
from gemps_server.wire.worker_certificates import WorkerCertificates

log = logging.getLogger("gemps.server")

# Connections a listener lets wait for accept() (the kernel's queue, not this process's memory).
BACKLOG = 128
# How long stop() waits for the loop's thread beyond the grace.
JOIN_SECONDS = 5.0
# Out of descriptors: how soon accepting is tried again (connections wait in the kernel's queue).
ACCEPT_RETRY_SECONDS = 0.05
OUT_OF_DESCRIPTORS = "out of descriptors: connections wait to be accepted"
PAUSED = "connections that prove no ticket come faster than --data-plane-refusals-per-second: accepting paused"
# accept() of a connection that went away while queued: the next in the queue may be taken.
DIED_IN_QUEUE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ETIMEDOUT, errno.ECONNRESET})


class DataPlaneServer:
    """`start()` binds and serves on a thread of its own; `stop(grace)` ends it gracefully."""

    def __init__(
        self,
        config: ServerConfig,
        service: ParameterService,
        metrics: ServerMetrics,
        certificates: WorkerCertificates | None = None,
    ) -> None:
        self._config = config
        self._service = service
        self._metrics = metrics
        self._limits = Limits(
            max_header_bytes=config.max_message_bytes,
            handshake_timeout=config.data_plane_hello_timeout,
            idle_timeout=config.connection_idle_timeout,
            pace=Pace(config.stream_idle_timeout, config.min_stream_bytes_per_second),
            shared_memory=SharedMemoryBudget(
                config.max_shared_memory * MIB, metrics, config.max_workers, config.memory_budget_mb * MIB
            ),
        )
        self._lanes = Lanes(
            config.data_plane_buffers, config.slow_upload_buffers, config.max_workers, config.max_reply_mb << 20
        )
        self._tls = tls_context(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls else None
        # With --tls-crl: checked after each TLS handshake, then at each HELLO and request.
        self._certificates = certificates
        self._loop = Loop()
        self._handshakes = (
            Handshakes(
                self._tls,
                self._loop,
                config.tls_handshake_threads,
                config.max_handshakes_per_source,
                config.handshake_cpu_per_source,
                certificates.revocations.refusal if certificates is not None else None,
            )
            if self._tls is not None
            else None
        )
        self._connections: dict[Task, Connection] = {}
        # Connections whose HELLO has not proved a ticket yet, oldest first: a budget of their own
        # (--max-unproven-data-connections), so those that send nothing cannot take every place.
        self._unproven: dict[Task, None] = {}
        self._unproven_budget = min(config.max_unproven_data_connections, config.max_data_connections)
        self._thread: threading.Thread | None = None
        self._stop_at: float | None = None  # set (from stop()) when the server stops: the grace's end
        self._stopping = threading.Event()
        self._refusal_log = Throttle(interval=1.0)
        # Descriptors kept for checkpoints and shutdown (descriptors.py); listeners out of
        # descriptors, waiting for their retry.
        self._descriptors = reserve()
        self._accept_pending: set[socket.socket] = set()
        self._full_log = Throttle(interval=10.0)
        # Per listener (by address family): connections that may end without proving a ticket.
        self._refusal_budgets = {
            family: RefusalBudget(config.data_plane_refusals_per_second)
            for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
        }
        self.port = 0
        self.local_socket = ""  # the Unix socket's abstract name (without its leading NUL), once bound

    def start(self) -> int:
        """Bind --host:--data-port (0: a free port) and start serving; the port bound."""
        family = socket.AF_INET6 if ":" in self._config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self._config.host, self._config.data_port))
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            raise
        self.port = listener.getsockname()[1]
        self._loop.listen(listener, self._accept)
        if self._config.shared_memory_on:
            self._listen_locally()
        if self._handshakes is not None:
            self._handshakes.start()
        self._thread = threading.Thread(target=self._run, name="gemps-data-plane", daemon=True)
        self._thread.start()
        return self.port

    def _listen_locally(self) -> None:
        """The abstract Unix socket (no file: nothing to clean up, invisible outside this network
        namespace); a random name, so a client elsewhere can never reach another server's."""
        name = f"gemps-data-{os.getpid()}-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + name)
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            raise
        self._loop.listen(listener, self._accept)
        self.local_socket = name

    def _run(self) -> None:
        loop = self._loop
        loop.thread_id = threading.get_ident()
        try:
            while not (self._stop_at is not None and self._stopped()):
                loop.run_once()
        finally:
            loop.close()  # ends the connections in handshake too: then their threads
            if self._handshakes is not None:
                self._handshakes.stop()

    # -- on the loop's thread ----------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        """Accept every connection waiting. The listener is edge-triggered: readiness is reported
        when one arrives, not while some wait, so one left in the queue is never reported again;
        out of descriptors, accepts are tried again on a timer until the queue is drained."""
        while True:
            if not self._descriptors.refill():  # the reserve first: connections never take it
                self._accept_later(listener)
                return
            paused = self._refusal_budgets[listener.family].delay()
            if paused:  # refusals came faster than their budget: the queue waits (refusal_budget.py)
                self._accept_later(listener, paused)
                return
            try:
                sock, _address = listener.accept()
            except BlockingIOError:  # the queue is drained
                return
            except OSError as error:
                if exhausted(error):
                    self._accept_later(listener)
                    return
                if error.errno in DIED_IN_QUEUE:
                    continue  # those behind it still wait
                return  # the listener is closed (the server stopping)
            accepted_at = time.monotonic()
            sock.setblocking(False)  # accept() hands out blocking sockets; refusing one must not block
            local = sock.family == socket.AF_UNIX
            if not local:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            admitted, handshake = self._admitted(sock, local)
            if not admitted:  # refused before it could cost another connection its place
                continue
            full = len(self._connections) >= self._config.max_data_connections
            if full or len(self._unproven) >= self._unproven_budget:
                if not self._unproven:  # every place is a worker's
                    self._refuse_connection(sock)
                    continue
                self._evict_oldest_unproven()
            self._open(sock, accepted_at, handshake)

    def _accept_later(self, listener: socket.socket, paused: float = 0.0) -> None:
        """Try `listener` again in ACCEPT_RETRY_SECONDS, out of descriptors, or in `paused` seconds,
        its refusal budget spent (once however often either happened meanwhile)."""
        if listener in self._accept_pending:
            return
        self._accept_pending.add(listener)
        why = "refusals" if paused else "descriptors"
        suppressed = self._full_log.allow(why)
        if suppressed is not None:
            event(log, PAUSED if paused else OUT_OF_DESCRIPTORS, level=logging.WARNING, retries=suppressed)

        def retry() -> None:
            self._accept_pending.discard(listener)
            if listener.fileno() != -1 and not self._stopping.is_set():
                self._accept(listener)

        self._loop.call_later(paused or ACCEPT_RETRY_SECONDS, retry)

    def _evict_oldest_unproven(self) -> None:
        """Make room for a newcomer: the connection that has waited longest without a HELLO goes
        (an honest client says HELLO at once, so it is proved long before it is the oldest)."""
        task = next(iter(self._unproven))
        self._loop.finish(task)  # its body's `finally` forgets it
        self._refused("unproven_limit")

    def _admitted(self, sock: socket.socket, local: bool) -> tuple[bool, HandshakeStart | None]:
        """Whether `sock` may have a place, and under TLS its handshake's start: past the bounds
        of its address (tls_handshakes.py) it is closed and counted before any handshake work."""
        if self._handshakes is None or local:  # a local socket's bytes never leave this host
            return True, None
        try:
            source = sock.getpeername()[0]
        except OSError:  # gone already
            sock.close()
            return False, None
        refusal = self._handshakes.admit(source)
        if refusal is not None:
            self._refusal_budgets[sock.family].charge()
            sock.close()
            self._refused("handshake_limit", detail=refusal)
            return False, None
        return True, functools.partial(self._handshakes.run, source)

    def _open(self, sock: socket.socket, accepted_at: float, handshake: HandshakeStart | None) -> None:
        budget = self._refusal_budgets[sock.family]
        channel = Channel(sock)
        connection = Connection(channel, self._service, self._metrics, self._limits, self._lanes, accepted_at)
        connection.handshake = handshake
        connection.certificates = self._certificates
        self._metrics.data_plane_connections.inc()

        def body(task: Task) -> Body:
            self._connections[task] = connection
            self._unproven[task] = None
            connection.on_proven = lambda: self._unproven.pop(task, None)
            try:
                yield from connection.serve(task)
            finally:
                self._connections.pop(task, None)
                if task in self._unproven:  # it ended without proving a ticket
                    del self._unproven[task]
                    budget.charge()
                self._metrics.data_plane_connections.dec()

        self._loop.spawn(channel, body)

    def _refuse_connection(self, sock: socket.socket) -> None:
        """Past --max-data-connections: say so if it fits in the socket's buffer now (not under
        TLS: that would cost a handshake), then close. Counted first: a client that reads the
        refusal may scrape the metric at once."""
        self._refused("too_many_connections")
        self._refusal_budgets[sock.family].charge()
        if self._tls is None or sock.family == socket.AF_UNIX:
            error = ResourceExhausted(
                f"more than {self._config.max_data_connections} data-plane connections (--max-data-connections)",
                Reason.TOO_LARGE,
            )
            with contextlib.suppress(OSError):
                sock.send(ServerConnection(0).send(ErrorReply(error_header(error))))
        sock.close()

    def _refused(self, reason: str, detail: str = "") -> None:
        self._metrics.data_plane_refused(reason)
        suppressed = self._refusal_log.allow(reason)
        if suppressed is not None:
            event(log, "data-plane connection refused", reason=reason, detail=detail or None, suppressed=suppressed)

    def _begin_stop(self) -> None:
        """Stop accepting; close the connections waiting for a request (or a buffer); the others
        finish the request they are serving (its reply is its acknowledgement)."""
        self._loop.stop_listening()
        self._lanes.turn_away()
        for task, connection in list(self._connections.items()):
            connection.stopping = True
            # Nothing of a connection that has not proved its ticket (in its TLS handshake or
            # HELLO) waits to be acknowledged: it goes now, not at the grace's end.
            if (task.waiting is not None and task.waiting.idle) or task in self._unproven:
                self._loop.finish(task)

    def _stopped(self) -> bool:
        """Done when no connection is left, or past the grace: then every socket is shut down, and
        a connection that waits for the applier (which may be writing its reply) ends after it."""
        assert self._stop_at is not None
        if not self._connections:
            return True
        if time.monotonic() < self._stop_at:
            return False
        for task in list(self._connections):
            task.channel.shutdown()
            waiting = task.waiting
            if not (isinstance(waiting, Parked) and waiting.pinned):
                self._loop.finish(task)
        return not self._connections

    # -- from other threads ----------------------------------------------------------------------

    @property
    def connections(self) -> int:
        return len(self._connections)

    def stop(self, grace: float) -> None:
        """Stop accepting; connections waiting for a request are closed now, those in the middle of
        one get `grace` seconds to send its reply, then every socket is shut down. Runs before
        the final checkpoint: a reply sent here is for a commit the state already applied."""
        if self._thread is None:
            return
        if not self._stopping.is_set():
            self._stopping.set()
            deadline = time.monotonic() + grace

            def begin() -> None:
                self._begin_stop()
                self._stop_at = deadline

            self._loop.post(begin)
        self._thread.join(grace + JOIN_SECONDS if math.isfinite(grace) else None)
