"""The data-plane transport: gRPC for control, θ's bytes on a socket of their own (DESIGN §3c).

A `DataPlaneTransport` composes a GrpcTransport, which carries Register, Leave, Status and
ReportEvaluation (and every call when the data plane is not used), and sends Commit and Pull
over the data plane that the server offered at Register (`Registration.data_plane`: a port on
the host this transport reached, and a ticket). The frames' headers are the gRPC path's messages
(`gemps.grpc_messages`), their replies read into the same records, so what a worker gets does not
depend on the plane.

On the server's host the connection goes to its local socket (DataPlane.local_socket) when it is
offered and reachable, else to the TCP port; a local connection attaches shared memory at its
first commit (θ's bytes then cross no socket), unless `shared_memory` is off. The connection opens
after each successful registration, and again when a call needs it after it broke. `mode` is
the Client's `plane`: "auto" uses gRPC for this server from then on (one warning) when the
offered port cannot be reached or refuses the connection, and tries the data plane again before
a later call, after a wait that doubles with each failure (from RETRY_FIRST to RETRY_MAX seconds,
jittered): a transient fault (a full server, a flood of connections, a restart) does not cost a
worker the data plane for good. The retry happens before the call's request is sent, so each call
goes whole on one plane, with the request id every attempt reuses. "data" raises. A
broken connection mid-call is ServerUnavailableError: the session retries with the same request
id (the server's ledger makes the commit exactly-once). A HELLO refused as an unknown worker is
WorkerNotFoundError: the session registers again and gets a new ticket.

Where the transport stands is one `Link` state, changed only by `_become` (the moves it allows
are `MOVES`): not offered, offered, connected, shared, fell back, closed.
"""

from __future__ import annotations

import logging
import random
import ssl
import time

from gemps import errors
from gemps import grpc_messages as messages
from gemps.channel_security import ChannelSecurity
from gemps.data_plane_connection import SHARED_MEMORY, DataConnection, ServerNotProven, Unreachable, target_host
from gemps.data_plane_link import MOVES, OPEN, RETRY_CONNECT_TIMEOUT, RETRY_FIRST, RETRY_JITTER, RETRY_MAX, Link
from gemps.data_plane_replies import read_committed, read_pulled
from gemps.grpc_transport import GrpcTransport
from gemps.records import Evaluation, Registration, ServerStatus
from gemps.transport import (
    CommitCall,
    Committed,
    Deferred,
    Enrolment,
    Failed,
    Pending,
    PullCall,
    Pulled,
    Registered,
    refuse_non_finite,
    time_left,
)
from gemps_proto import vectors
from gemps_proto.data_plane_frames import Op
from gemps_proto.reasons import Reason
from gemps_proto.schema import DataPlane
from gemps_proto.tensor_codec import FLOAT32

log = logging.getLogger("gemps.client")
_now = time.monotonic  # the retries' clock (a seam for tests)


class DataPlaneTransport:
    """One server process: Commit and Pull on its data plane, the rest (and the fallback) on gRPC."""

    def __init__(
        self, grpc: GrpcTransport, connection: ChannelSecurity, *, mode: str = "auto", shared_memory: bool = True
    ) -> None:
        if mode not in ("auto", "data"):
            raise ValueError(f"a data-plane transport's mode is auto or data, not {mode!r}")
        self.grpc = grpc
        self.mode = mode
        # Same host: the local socket, and shared memory on it (both when offered and possible).
        # What this host turned out to allow, not where the transport stands (that is `state`).
        self._wants_local = shared_memory and SHARED_MEMORY
        self._local = self._attach_memory = self._wants_local
        # Whether a local connection was ever made to this server (its socket failing then is a
        # fallback from shared memory, said and counted), and when to try it again (None: no need).
        self._been_local = False
        self._local_due: float | None = None
        self._local_wait = RETRY_FIRST
        self.shared_memory_fallbacks = 0  # connections made without shared memory though it was used
        self.host = target_host(grpc.target)
        self._server_name = connection.server_name
        self._tls: ssl.SSLContext | None = connection.ssl_context() if connection.tls else None
        self._offer: DataPlane | None = None  # the newest registration's port and ticket
        self._worker_id = ""  # whose registration the offer is
        # A ticket of a registration made with another replica of this partition (resume()): this
        # server's port for it is asked of its Status by the next call that needs it.
        self._resumed: bytes | None = None
        self.state = Link.NOT_OFFERED
        self._connection: DataConnection | None = None  # CONNECTED and SHARED only
        self._retry_at: float | None = None  # FELL_BACK only: when to try the data plane again
        self._retry_wait = RETRY_FIRST
        self.returns = 0  # times the data plane was used again after a fallback

    def _become(self, state: Link, connection: DataConnection | None = None, *, retry_at: float | None = None) -> None:
        """The one place the state changes: a connection it no longer holds is closed; CONNECTED
        and SHARED hold `connection`, FELL_BACK a time to try again (`retry_at`)."""
        if state is not self.state and state not in MOVES[self.state]:
            raise RuntimeError(f"data-plane transport of {self.target}: {self.state.value} -> {state.value}")
        if state in OPEN:
            connection = connection or self._connection
            assert connection is not None, state
        else:
            connection = None
        if self._connection is not None and self._connection is not connection:
            self._connection.close()
        if state is Link.FELL_BACK:
            assert retry_at is not None
        elif self.state is Link.FELL_BACK and state is Link.CONNECTED:
            self.returns += 1  # back on the data plane
        self.state, self._connection, self._retry_at = state, connection, retry_at

    @property
    def fell_back(self) -> bool:
        """auto: the data plane could not be used; gRPC until a later attempt succeeds."""
        return self.state is Link.FELL_BACK

    @property
    def target(self) -> str:
        return self.grpc.target

    @property
    def plane(self) -> str:
        """How commits and pulls travel now: "data" (the data plane), else "grpc"."""
        return "data" if self._offer is not None and self.state in (Link.OFFERED, *OPEN) else "grpc"

    @property
    def shared(self) -> bool:
        """Commits and pulls go through shared memory with the server now."""
        return self.state is Link.SHARED and self._connection is not None and not self._connection.closed

    @property
    def ticket(self) -> bytes | None:
        return None if self._offer is None else self._offer.ticket

    # -- Register: gRPC, then the data plane it offered ----------------------------------------------

    def register(self, enrolment: Enrolment, known_history: str) -> Registered:
        registered = self.grpc.register(enrolment, known_history)
        self._attach(registered.registration)
        return registered

    def resume(self, registration: Registration) -> None:
        """A registration made with another replica of this partition: the replicas share its
        worker and the key of its ticket, so its ticket opens this server's data plane too, at the
        port this server's Status says, asked by the next commit or pull (a failover: the SDK goes
        on at the new primary on the data plane, without registering again)."""
        if registration.data_plane is not None and self._offer is None and not self.fell_back:
            self._worker_id, self._resumed = registration.worker_id, registration.data_plane.ticket

    def _offer_here(self) -> None:
        """The resumed registration's offer at this server: its data plane's port from Status (which
        raises while the server is down: the call's retry asks again), with the ticket we hold."""
        assert self._resumed is not None
        here = self.grpc.status().data_plane
        ticket, self._resumed = self._resumed, None
        if here is None:
            self._no_offer()
            return
        self._offer = DataPlane(here.port, ticket, here.local_socket)
        self._become(Link.OFFERED)

    def _attach(self, registration: Registration) -> None:
        """Take a registration's offer and connect now: a port that cannot be reached is found at
        once, while gRPC has just answered (later, a server restarting looks the same)."""
        if self._offer and registration.data_plane and registration.data_plane.local_socket != self._offer.local_socket:
            self._local = self._attach_memory = self._wants_local  # another server: its local socket again
        self._offer, self._worker_id, self._resumed = registration.data_plane, registration.worker_id, None
        if self.fell_back:
            return
        self._become(Link.NOT_OFFERED if self._offer is None else Link.OFFERED)
        if self._offer is None:
            self._no_offer()
            return
        try:
            self._become(Link.CONNECTED, self._open(self._offer))
        except Unreachable as unreachable:
            self._unusable(unreachable.address, unreachable.why)
        except errors.GempsError as error:
            if not errors.worth_another_attempt(error):  # refused: not for a retry to fix
                self._unusable(f"{self.host}:{self._offer.port}", error.message, error)
            # else: opened again by the next call, which raises what that one meets

    def _no_offer(self) -> None:
        """This server offers no data plane: gRPC (auto), or say so (data)."""
        if self.mode == "data":
            raise errors.FailedPreconditionError(
                f"{self.target} offers no data plane (started with --data-plane off?), and plane='data'",
                errors.FailedPreconditionError.code,
            )
        log.debug("%s offers no data plane: using gRPC", self.target)

    def _open(self, offer: DataPlane, timeout: float | None = None) -> DataConnection:
        """The local socket when offered and reachable (this host), else the TCP port; HELLO sent,
        each within `timeout` (the calls' own timeout by default) and the call's deadline."""
        limit = self.grpc.timeout if timeout is None else timeout  # each try within the call's deadline
        if self._local and offer.local_socket:
            local = self._open_local(offer, limit)
            if local is not None:
                return local
        connection = DataConnection.open(
            self.host, offer.port, timeout=time_left(limit), tls=self._tls, server_name=self._server_name
        )
        return self._hello(connection, offer)

    def _open_local(self, offer: DataPlane, limit: float) -> DataConnection | None:
        """The local socket's connection, HELLO answered; None: TCP this time. Not answering may be
        another host's socket or its server restarting (alike: a name no process holds), so it is
        tried again later (`_local_due`, a doubling wait) and a client on a TCP connection moves to
        it between calls (back on shared memory after a restart, issue 61 item 2)."""
        try:
            connection = self._hello(DataConnection.open_local(offer.local_socket, timeout=time_left(limit)), offer)
        except (Unreachable, errors.GempsError) as failed:
            if isinstance(failed, ServerNotProven):  # an impostor took a dead server's socket name
                log.warning("local socket of %s not used (%s): TCP", self.target, failed)
                self._local = self._attach_memory = False
            elif self._been_local and self._local_due is None:  # the first failure after using it
                self._fell_from_shared(f"its local socket is not answering ({failed})")
            else:
                log.debug("local socket of %s not used (%s): TCP", self.target, failed)
            self._local_due, self._local_wait = _now() + self._local_wait, min(2 * self._local_wait, RETRY_MAX)
            return None
        self._been_local, self._local_due, self._local_wait = True, None, RETRY_FIRST
        return connection

    def _back_on_local(self) -> None:
        """On a TCP connection where the local socket failed before: try it again once the wait is
        over, and move to it (between calls) if it answers now."""
        assert self._offer is not None
        local = self._open_local(self._offer, min(self.grpc.timeout, RETRY_CONNECT_TIMEOUT))
        if local is not None:
            self._become(Link.CONNECTED, local)  # the TCP connection closed
            log.info("local socket of %s answers again: shared memory from the next call", self.target)

    def _hello(self, connection: DataConnection, offer: DataPlane) -> DataConnection:
        try:
            connection.hello(self._worker_id, offer.ticket)
        except BaseException:
            connection.close()
            raise
        return connection

    def _attached(self, connection: DataConnection, size: int) -> bool:
        """Attach shared memory of `size` bytes to `connection` (SHARED); False when the server
        refused it, which costs the connection (OFFERED again): no more attempts for this server."""
        try:
            connection.attach(size)
        except OSError as error:  # no memfd here (a sandbox): the local socket alone
            self._fell_from_shared(f"no shared memory on this host ({error})")
            self._attach_memory = False
            return True
        except errors.GempsError as error:
            if errors.worth_another_attempt(error):
                raise
            self._fell_from_shared(f"the server refused it ({error.message})")
            self._attach_memory = False
            self._become(Link.OFFERED)
            return False
        self._become(Link.SHARED)
        return True

    def _fell_from_shared(self, why: str) -> None:
        """θ goes on a socket where shared memory was wanted: said and counted, never silent."""
        self.shared_memory_fallbacks += 1
        log.warning("shared memory with %s not used: %s; θ goes on a socket", self.target, why)

    def _unusable(self, address: str, why: str, error: errors.GempsError | None = None) -> None:
        """auto: gRPC for this server until the next attempt (said once per fallback); data: raise."""
        if self.mode == "data":
            if error is not None:
                raise error
            raise errors.ServerUnavailableError(
                f"UNAVAILABLE: data plane of {self.target} at {address} unreachable: {why}",
                errors.ServerUnavailableError.code,
            )
        if self.fell_back:  # a retry failed: wait twice as long
            self._retry_wait = min(2 * self._retry_wait, RETRY_MAX)
            log.debug("data plane of %s at %s still cannot be used (%s)", self.target, address, why)
        else:
            self._retry_wait = RETRY_FIRST
            log.warning(
                "data plane of %s at %s cannot be used (%s): using gRPC for this server, trying again later",
                self.target,
                address,
                why,
            )
        jitter = 1 + RETRY_JITTER * (2 * random.random() - 1)
        self._become(Link.FELL_BACK, retry_at=_now() + self._retry_wait * jitter)

    def _try_again(self) -> None:
        """Fallen back, and the wait is over: open the data plane again (the local socket and
        shared memory too, if they were wanted). Nothing of any call is sent here."""
        assert self._offer is not None
        self._local = self._attach_memory = self._wants_local
        try:
            connection = self._open(self._offer, min(self.grpc.timeout, RETRY_CONNECT_TIMEOUT))
        except Unreachable as unreachable:
            self._unusable(unreachable.address, unreachable.why)
            return
        except errors.GempsError as error:
            self._unusable(f"{self.host}:{self._offer.port}", error.message, error)
            return
        connection.sock.settimeout(self.grpc.timeout)  # the calls' timeout from now on
        self._become(Link.CONNECTED, connection)  # a return
        log.info("data plane of %s at %s usable again: commits and pulls go there", self.target, connection.address)

    def _ready(self, worker_id: str, shared_bytes: int = 0) -> DataConnection | None:
        """The connection for a call by `worker_id`, opened again if it broke, with `shared_bytes`
        of shared memory attached where it can be (a local connection); None: gRPC."""
        if self._resumed is not None and worker_id and worker_id == self._worker_id:
            self._offer_here()
        due = self._retry_at is not None and _now() >= self._retry_at
        if due and self._offer is not None and worker_id and worker_id == self._worker_id:
            self._try_again()
        if self.plane != "data" or not worker_id or worker_id != self._worker_id:
            return None  # not offered, fallen back, or a read-only pull (no registration, no ticket)
        assert self._offer is not None
        if self._connection is not None and (self._connection.closed or self._connection.awaiting):
            self._become(Link.OFFERED)  # broke, or a reply was never read (a fan-out that gave up)
            self._attach_memory = self._wants_local and self._local  # a server restarted may take it again
        local_due = self._local_due is not None and _now() >= self._local_due and self._local
        if local_due and self.state is Link.CONNECTED and self._connection is not None and not self._connection.local:
            self._back_on_local()
        for _attempt in range(2):  # a refused ATTACH costs its connection: one more, without
            if self.state is Link.OFFERED:
                try:
                    self._become(Link.CONNECTED, self._open(self._offer))
                except Unreachable as unreachable:
                    raise self._stale_offer(unreachable) from None
                except errors.GempsError as error:
                    if errors.worth_another_attempt(error):
                        raise
                    self._unusable(f"{self.host}:{self._offer.port}", error.message, error)
                    return None
            connection = self._connection
            assert connection is not None
            wants_shared = shared_bytes and self._attach_memory and connection.local
            if self.state is Link.SHARED or not wants_shared or self._attached(connection, shared_bytes):
                return self._connection
        raise AssertionError("unreachable: the second attempt attaches nothing")

    def _stale_offer(self, unreachable: Unreachable) -> errors.GempsError:
        """The data port of our registration stopped answering. gRPC down too: the server is down
        (retried). gRPC up: it restarted elsewhere or without a data plane, and registering again
        gets its current offer (or none)."""
        with errors.gone_if_foreign(self.target):  # raises UNAVAILABLE while the server is down
            self.grpc.status()
        return errors.WorkerNotFoundError(
            f"data plane of {self.target} at {unreachable.address} unreachable ({unreachable.why}) while "
            "gRPC answers: registering again for the server's current offer",
            errors.WorkerNotFoundError.code,
            Reason.UNKNOWN_WORKER,
        )

    # -- Commit and Pull ---------------------------------------------------------------------------

    def start_commit(self, call: CommitCall) -> Pending[Committed]:
        try:
            # shared memory where it can be: θ's float32 bytes on this server
            connection = self._ready(call.worker_id, 4 * vectors.size(call.payload))
            if connection is None:
                return self.grpc.start_commit(call)
            dtype, data = call.wire(self.grpc.wire_dtype)
            # Checked where it is copied (the shared memory, in cache then) when it goes as float32 values.
            on_copy = call.check_finite and connection.shared and call.encoded is None and dtype == FLOAT32
            if call.check_finite and not on_copy:
                refuse_non_finite("payload", call.payload)
            header = messages.announced_commit(call, self.grpc.wire_dtype, dtype).SerializeToString()
            connection.bound(self.grpc.timeout)
            connection.send(Op.COMMIT, header, data, finite="payload" if on_copy else None)
        except errors.GempsError as error:
            return Failed(error)
        return Deferred(lambda: read_committed(connection, self.grpc.timeout))

    def commit(self, call: CommitCall) -> Committed:
        return self.start_commit(call).result()

    def start_pull(self, call: PullCall) -> Pending[Pulled]:
        try:
            connection = self._ready(call.worker_id)
            if connection is None:
                return self.grpc.start_pull(call)
            connection.bound(self.grpc.timeout)
            connection.send(Op.PULL, messages.pull_request(call, self.grpc.wire_dtype))
        except errors.GempsError as error:
            return Failed(error)
        return Deferred(lambda: read_pulled(connection, self.grpc.timeout))

    def pull(self, call: PullCall) -> Pulled:
        return self.start_pull(call).result()

    # -- the small calls: gRPC -------------------------------------------------------------------

    def leave(self, worker_id: str) -> None:
        try:
            self.grpc.leave(worker_id)
        finally:  # the registration, and so its ticket, is gone
            self._offer, self._worker_id, self._resumed = None, "", None
            if not self.fell_back:
                self._become(Link.NOT_OFFERED)

    def status(self) -> ServerStatus:
        return self.grpc.status()

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self.grpc.report_evaluation(evaluation)

    def interrupt(self) -> None:
        connection = self._connection
        if connection is not None:
            connection.wake()
        self.grpc.interrupt()

    def close(self) -> None:
        self._become(Link.CLOSED)
        self.grpc.close()

    def _drop(self) -> None:
        """Close the connection (the next call opens another)."""
        if self.state in OPEN:
            self._become(Link.OFFERED)
