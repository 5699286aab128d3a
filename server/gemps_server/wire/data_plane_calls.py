"""One data-plane connection's server side: the handshake that proves both ends hold the worker's
ticket, then one request and its reply at a time, each a Commit or a Pull answered as the gRPC
path answers it.

`Connection.serve` is written as a generator the loop drives (data_plane_loop.py): each `yield` is
something it waits for without holding the thread. What the bytes mean, and every refusal that
needs only them, is the protocol core's (gemps_proto/data_plane_protocol.py, a ServerConnection):
this module reads exactly the bytes it asks for and does what needs the service, the kernel or
the clock. Sizes are checked before the bytes they announce are read: the preamble's header
length against --max-message-mb (the core), a commit's payload length against the dtype and shape
its header announces (service.expected_payload_bytes, here).
A request refused before its payload was read is answered with an ERROR frame and the connection
closed (its unread bytes are never read); one refused after it was read whole (NaN, unknown
worker, base version) leaves the connection usable. A payload on the socket lands in a θ-sized
pooled buffer, read on the fast or the slow lane (data_plane_uploads.py); the reply's θ is copied
into the same buffer while θ holds the commit's version and sent from there. A payload in the
client's shared memory is handed to the core where it lies (the core reads it once, held to the
peak it checked, or copies it first: CommitCore._landed) and takes no pooled buffer; the reply's
θ is written into the client's memory (by GEM's pass itself, for float32) and only announced. A
reply whose reader lags holds no pooled buffer (data_plane_replies.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from gemps_proto import proofs
from gemps_proto.data_plane_events import (
    NEED_DATA,
    Answer,
    AttachRequested,
    ChallengeReceived,
    CommitHeader,
    ErrorReply,
    HelloReceived,
    NeedData,
    PayloadComplete,
    ProtocolError,
    PullRequested,
    Reply,
    ServerEvent,
)
from gemps_proto.data_plane_frames import Op
from gemps_proto.data_plane_protocol import ServerConnection
from gemps_proto.reasons import Reason
from gemps_proto.tensor_codec import FLOAT32, EncodedTensor
from gemps_server.commit_frame import commit_from_proto, reply_dtype_from_proto
from gemps_server.domain.applier import ApplierStopped
from gemps_server.domain.errors import DeadlineExceeded, InvalidArgument, ServiceError
from gemps_server.domain.records import CommitOutcome, ReplyWriter
from gemps_server.metrics import ServerMetrics
from gemps_server.native import max_abs
from gemps_server.service import ParameterService
from gemps_server.wire import messages, shared_memory
from gemps_server.wire.data_plane_io import Channel, Hangup, PeerClosed, Revoked, Stalled, Unread, close_fds, pieces
from gemps_server.wire.data_plane_loop import Call, ReadInto, Task, Wait, Write
from gemps_server.wire.data_plane_replies import held_until_moved, pull_room, reply_room, write_reply
from gemps_server.wire.data_plane_uploads import Held, Lanes
from gemps_server.wire.shared_memory import SharedRegion
from gemps_server.wire.shared_memory_budget import SharedMemoryBudget
from gemps_server.wire.status_codes import error_header, error_of, internal, status_of
from gemps_server.wire.streams import Pace
from gemps_server.wire.worker_certificates import ConnectionCertificates, WorkerCertificates

Steps = Generator[Wait, Any, Any]
# Under TLS, how a connection gets its handshake done by a deadline (tls_handshakes.Handshakes.run).
HandshakeStart = Callable[[Task, float], Steps]
METHODS: dict[int, str] = {Op.COMMIT: "Commit", Op.PULL: "Pull"}
# What a refused HELLO counts as, by its reason (anything else: bad_hello).
HELLO_REFUSALS = {
    Reason.UNAUTHENTICATED: "unauthenticated",
    Reason.UNKNOWN_WORKER: "unknown_worker",
    Reason.NOT_PRIMARY: "not_primary",
}


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int  # --max-message-mb
    handshake_timeout: float  # accept to HELLO answered, TLS included
    idle_timeout: float  # between requests (--connection-idle-timeout)
    # gRPC's streams' pace: no byte for pace.idle_timeout mid-frame or mid-reply, and a payload
    # or a reply moving slower than pace.min_bytes_per_second on average, end the connection
    pace: Pace
    shared_memory: SharedMemoryBudget  # what local connections may attach together (--max-shared-memory)

    @property
    def stream_timeout(self) -> float:
        return self.pace.idle_timeout


class Connection:
    """Serves one accepted connection: `serve(task)` is the generator its loop task runs. What
    the frames mean is the protocol core's (gemps_proto/data_plane_protocol.py); this reads the
    bytes it asks for, and does what needs the service, the kernel or the clock."""

    def __init__(
        self,
        channel: Channel,
        service: ParameterService,
        metrics: ServerMetrics,
        limits: Limits,
        lanes: Lanes,
        accepted_at: float,
    ) -> None:
        self.channel = channel
        self._service = service
        self._metrics = metrics
        self._limits = limits
        self._lanes = lanes
        self._accepted_at = accepted_at
        self._protocol = ServerConnection(limits.max_header_bytes)
        self._task: Task | None = None
        self._region: SharedRegion | None = None  # the shared memory attached (local connections)
        self.stopping = False  # the server is stopping: end after the request being served
        self.on_proven: Callable[[], None] = _nothing  # called once its HELLO proved a ticket
        # Under TLS: its handshake by a deadline, done off the loop's thread (tls_handshakes.py).
        self.handshake: HandshakeStart | None = None
        # With --tls-crl: whose certificates its requests answer for, once its HELLO proved a ticket.
        self.certificates: WorkerCertificates | None = None
        self._answers_for: ConnectionCertificates | None = None

    def serve(self, task: Task) -> Generator[Wait, Any, None]:
        """The TLS handshake, the HELLO, then requests until the peer leaves, a guard closes the
        connection, or the server stops."""
        self._task = task
        try:
            if self.handshake is not None:
                yield from self._handshake(self.handshake(task, self._accepted_at + self._limits.handshake_timeout))
            yield from self.hello()
            self.on_proven()
            self.channel.fd_budget = 1  # the memfd an ATTACH carries (none before: data_plane_io.py)
            while not self.stopping:
                yield from self.request()
        except Hangup as hangup:
            if hangup.reason is not None:
                self._metrics.data_plane_refused(hangup.reason)
        except (PeerClosed, Stalled):
            pass  # nothing was pending: the peer went away (a stall here is past the reply)
        finally:
            if self._region is not None:
                self._region.close()

    def _handshake(self, handshake: Steps) -> Steps:
        try:
            yield from handshake
        except Stalled:
            raise Hangup("handshake_timeout") from None
        except Revoked:
            raise Hangup("revoked_certificate") from None
        except PeerClosed:
            raise Hangup("tls") from None

    # -- the hello ----------------------------------------------------------------------------

    def hello(self) -> Steps:
        """The handshake, before anything else is read (gemps_proto/proofs.py): answer
        the CHALLENGE with this server's proof (made with the worker's ticket), then accept the
        HELLO if its proof is the ticket's (the core checks it). Hangup otherwise (an ERROR frame
        sent first where one can be)."""
        challenge = yield from self._handshake_event()
        assert isinstance(challenge, ChallengeReceived), challenge
        try:
            ticket = self._service.data_plane_ticket(challenge.worker_id)
        except ServiceError as error:
            raise (yield from self._refuse(error, HELLO_REFUSALS.get(error.reason, "bad_hello"))) from None
        offer, deadline = self._service.data_plane, self._accepted_at + self._limits.handshake_timeout
        here = proofs.address(offer.port or 0, offer.local_socket if self.channel.local else "")
        yield Write(pieces([self._protocol.send(Answer(ticket, here))]), self._limits.handshake_timeout, deadline)
        hello = yield from self._handshake_event()
        assert isinstance(hello, HelloReceived), hello
        if self.certificates is not None:
            self._answers_for = self.certificates.of_connection(hello.worker_id, self.channel.sock)
            if (distrusted := self._distrusted()) is not None:
                raise (yield from self._refuse(distrusted.error, distrusted.refusal))
        yield from self._send(worker_id=hello.worker_id)

    def _distrusted(self) -> Unread | None:
        """With --tls-crl, once the certificate this connection answers for is revoked: the refusal
        of its HELLO or of each request after (then it closes: worker_certificates.py)."""
        refused = self._answers_for.refusal() if self._answers_for is not None else None
        if refused is None:
            return None
        revoked = refused.reason is Reason.REVOKED_CERTIFICATE
        return Unread(refused, "revoked_certificate" if revoked else "unauthenticated")

    def _handshake_event(self) -> Generator[Wait, Any, ServerEvent]:
        """The handshake's next frame, read within the handshake's time, with no descriptor."""
        try:
            event = yield from self._event(
                self._limits.handshake_timeout, self._accepted_at + self._limits.handshake_timeout
            )
        except Stalled:
            raise Hangup("handshake_timeout") from None
        except PeerClosed:
            raise Hangup("bad_hello") from None
        if isinstance(event, ProtocolError):
            if event.reason is Reason.UNAUTHENTICATED:  # a wrong proof: as the gRPC port counts a bad token
                self._metrics.refusal(Reason.UNAUTHENTICATED)
            raise (yield from self._refuse(error_of(event), event.refusal))
        try:
            self._no_descriptors()
        except ServiceError as error:
            raise (yield from self._refuse(error, "bad_hello")) from None
        return event

    # -- requests ------------------------------------------------------------------------------

    def request(self) -> Steps:
        """Serve one request (waiting for it first, as long as --connection-idle-timeout)."""
        protocol = self._protocol
        view = protocol.read_view()  # the next frame's preamble
        received = self.channel.received
        wait = ReadInto(view, self._limits.idle_timeout, idle=True, then_stall=self._limits.stream_timeout)
        try:
            yield wait
        except Stalled:
            if wait.idle:
                raise Hangup("idle_timeout") from None
            self._stalled()
        started = time.perf_counter()
        try:
            protocol.received(len(view))
            method = METHODS.get(protocol.frame.op) if protocol.frame is not None else None
            if method is not None:
                yield from self._serve(method, started, received)
                return
            event = yield from self._event(self._limits.stream_timeout)
            if isinstance(event, ProtocolError):
                raise (yield from self._refuse(error_of(event), event.refusal))
            assert isinstance(event, AttachRequested), event
            yield from self._attach(event)
        except Stalled:
            self._stalled()

    def _serve(self, method: str, started: float, received: int) -> Steps:
        sent = self.channel.sent
        try:
            event = yield from self._event(self._limits.stream_timeout)
            if isinstance(event, ProtocolError):
                raise Unread(error_of(event), event.refusal)
            if (distrusted := self._distrusted()) is not None:
                raise distrusted
            self._no_descriptors(unread=True)
            if isinstance(event, CommitHeader):
                yield from self._commit(event)
            else:
                assert isinstance(event, PullRequested), event
                yield from self._pull(event)
        except Unread as unread:
            self._rejected(method, unread.error)
            raise (yield from self._refuse(unread.error, unread.refusal)) from None
        except ServiceError as error:  # the frame was read whole: the connection stays usable
            self._rejected(method, error)
            yield from self._send_error(error)
        except (Hangup, PeerClosed, Stalled, ApplierStopped):  # the connection ends, as it should
            raise
        except Exception as failure:  # a bug: INTERNAL to the client, then closed (where it stopped is unknown)
            failed = internal(method, failure)
            self._rejected(method, failed)
            raise (yield from self._refuse(failed, "internal")) from None
        finally:
            channel = self.channel  # one call into the families, on every request (ServerMetrics' hot-path note)
            seconds = time.perf_counter() - started
            self._metrics.traffic.call(method, seconds, channel.received - received, channel.sent - sent, plane="data")

    def _commit(self, header: CommitHeader) -> Steps:
        service, request = self._service, header.request
        dtype, shape = request.payload.dtype, tuple(request.payload.shape)
        try:
            expected = service.expected_payload_bytes(dtype, shape)
            if header.payload_bytes != expected:
                raise InvalidArgument(
                    f"payload of {header.payload_bytes} bytes; its dtype and shape make {expected}",
                    Reason.BAD_PAYLOAD,
                )
        except ServiceError as error:
            raise Unread(error) from None
        task = self._task
        assert task is not None
        if header.shared:  # in the client's memory (the core refuses a SHARED frame without it): read there
            assert self._region is not None
            yield from self._commit_shared(header, EncodedTensor(dtype, shape, self._region.view[:expected]))
            return
        # On the socket: read whole on the fast lane, or the slow one (uploads).
        held = yield from self._lanes.receive(task, request.worker_id, expected, self._limits.pace)
        self._protocol.payload_landed()
        assert isinstance(self._protocol.next_event(), PayloadComplete)
        try:
            buffer = held.buffer
            data = buffer.take(expected).data  # the payload, landed in the buffer
            payload = EncodedTensor(dtype, shape, data)
            commit = commit_from_proto(request, payload, _peak(data, dtype), history=service.history)
            # The reply's θ is placed in the pooled buffer while θ holds the commit's version, then sent.
            writer = messages.stream_commit_reply(buffer)
            outcome, theta = yield Call(lambda deliver: service.commit_then(commit, writer, deliver))
            yield from self._send(_reply_header(outcome, commit.reply_dtype, service), theta, held=held)
        finally:
            held.give_back()

    def _commit_shared(self, header: CommitHeader, payload: EncodedTensor) -> Steps:
        """A commit whose payload is in the client's shared memory: no pooled buffer; the reply's θ
        goes there too, written by the rule's pass itself for float32 (a mirror)."""
        assert isinstance(self._protocol.next_event(), PayloadComplete)
        region, service = self._region, self._service
        assert region is not None
        commit = commit_from_proto(header.request, payload, volatile=True, history=service.history)
        writer: ReplyWriter[memoryview]
        mirror: np.ndarray | None
        if commit.reply_dtype == FLOAT32:  # the rule writes θ into the client's memory (a mirror)
            writer, mirror = messages.written_there, region.floats
        else:  # θ encoded, then copied there
            writer, mirror = messages.stream_commit_reply(region.buffer), None
        outcome, theta = yield Call(lambda deliver: service.commit_then(commit, writer, deliver, mirror))
        yield from self._send(_reply_header(outcome, commit.reply_dtype, service), theta)

    def _pull(self, pull: PullRequested) -> Steps:
        service, request, worker_id = self._service, pull.request, pull.request.worker_id
        known = request.known_version if request.known_history == service.history else -1
        dtype, wait = reply_dtype_from_proto(request.reply_dtype), request.wait_seconds
        # No pooled buffer: θ goes from the version's shared encoding, what it pins bounded by the
        # reply budget, held before the snapshot is taken (data_plane_replies.py).
        task = self._task
        assert task is not None
        if wait and service.unchanged(known):  # held first: θ may then come with the reply (its room below)
            yield from held_until_moved(task, wait, lambda wake: service.when_moved(known, wait, wake, worker_id))
        room = pull_room(dtype, service.num_parameters, sent=not pull.shared and not service.unchanged(known))
        if room:
            yield from reply_room(self._lanes.replies, task, room)
        try:
            snapshot = yield Call(lambda deliver: service.pull_then(worker_id, known, dtype, deliver, wait))
            unchanged, takes_next = service.unchanged(known, snapshot.version), service.round_takes_next(worker_id)
            reply = messages.pull_stream_header_to_proto(
                snapshot, unchanged, dtype, service.num_parameters, service.history, takes_next
            ).header
            data = b"" if unchanged else snapshot.data(dtype) or b""
            if pull.shared:
                assert self._region is not None
                data = self._region.buffer.copy_in(data)
            yield from self._send(reply.SerializeToString(), data)
        finally:
            if room:
                self._lanes.replies.give_back(room)

    def _attach(self, attach: AttachRequested) -> Steps:
        """ATTACH: map the memfd the frame carries as this connection's shared memory (local
        connections, once, once θ is initialised). A refusal closes the connection."""
        fds: list[int] = []
        try:
            fds = self.channel.take_fds()
            if not self.channel.local:
                raise InvalidArgument("shared memory is for local (Unix socket) connections", Reason.MALFORMED)
            if len(fds) != 1 or self.channel.fds_cut:
                raise InvalidArgument(f"an ATTACH carries one descriptor, not {len(fds)}", Reason.MALFORMED)
            self._service.require_initialized()
            budget, owner = self._limits.shared_memory, self._protocol.worker_id  # charged to the worker
            theta = 4 * self._service.num_parameters
            self._region = shared_memory.attach(fds.pop(), attach.size, theta, budget, owner)
        except ServiceError as error:
            close_fds(fds)
            refusal = "shared_memory_limit" if error.reason is Reason.SHARED_MEMORY_LIMIT else "bad_attach"
            raise (yield from self._refuse(error, refusal)) from None
        yield from self._send()

    def _no_descriptors(self, unread: bool = False) -> None:
        """Refuse a frame that passed descriptors (only an ATTACH may): InvalidArgument (or Unread)."""
        if self.channel.fds or self.channel.fds_cut:
            close_fds(self.channel.take_fds())
            error = InvalidArgument("descriptors passed with a frame other than ATTACH", Reason.MALFORMED)
            raise Unread(error) if unread else error

    # -- helpers -------------------------------------------------------------------------------

    def _event(self, stall: float, deadline: float | None = None) -> Generator[Wait, Any, ServerEvent]:
        """The protocol's next event, reading exactly the bytes it asks for until there is one."""
        protocol = self._protocol
        while (event := protocol.next_event()) is NEED_DATA:
            view = protocol.read_view()
            yield ReadInto(view, stall, deadline)
            protocol.received(len(view))
        assert not isinstance(event, NeedData)
        return event

    def _rejected(self, method: str, error: ServiceError) -> None:
        error.__traceback__ = None  # holds the request's frames otherwise (see grpc_servicer.rpc)
        self._service.rejected(method, error, status_of(error).name)

    def _send(
        self, header: bytes = b"", payload: bytes | memoryview = b"", *, worker_id: str = "", held: Held | None = None
    ) -> Steps:
        """The reply to the request read: its payload on the socket, from its own memory (the
        pooled buffer `held`, for a commit's θ), or (a SHARED request) already in the shared
        memory. A peer that does not read it holds no pooled buffer (data_plane_replies.py)."""
        frame = self._protocol.frame
        shared = frame is not None and frame.shared
        data = memoryview(payload).cast("B")
        start = self._protocol.send(Reply(header, len(data)), worker_id)
        views = pieces([start] if shared else [start, data])
        yield from write_reply(self.channel, views, 0 if shared else len(data), self._limits.pace, self._lanes, held)

    def _deadline(self, nbytes: int) -> float:
        """When `nbytes` of payload must have moved: a client that trickles bytes just fast
        enough to beat the stall timeout still gives its pooled buffer back."""
        return time.monotonic() + self._limits.pace.allowance(nbytes)

    def _send_error(self, error: ServiceError) -> Steps:
        start = self._protocol.send(ErrorReply(error_header(error)))
        yield Write(pieces([start]), self._limits.stream_timeout, self._deadline(0))

    def _refuse(self, error: ServiceError, refusal: str) -> Generator[Wait, Any, Hangup]:
        """Count the refusal as `refusal`, then answer `error` if the peer still listens (counted
        first: a client that read the answer may scrape the metric at once); the Hangup that ends
        the connection, for the caller to raise: `raise (yield from self._refuse(...))`."""
        self._metrics.data_plane_refused(refusal)
        with contextlib.suppress(PeerClosed, Stalled):
            yield from self._send_error(error)
        return Hangup(None)

    def _stalled(self) -> NoReturn:
        """No byte for --stream-idle-timeout in the middle of a frame or reply: end it (the error
        is sent only if it fits now: never wait on this peer)."""
        error = DeadlineExceeded(
            f"nothing moved for {self._limits.stream_timeout:g}s in the middle of a frame", Reason.STREAM_IDLE
        )
        self._metrics.data_plane_refused("stream_timeout")  # first, as _refuse counts
        self.channel.try_send(self._protocol.send(ErrorReply(error_header(error))))
        raise Hangup(None)


def _nothing() -> None:
    pass


def _reply_header(outcome: CommitOutcome, reply_dtype: int, service: ParameterService) -> bytes:
    """A commit's reply header: its outcome, and θ announced in the reply's dtype (unless unchanged)."""
    return messages.announced_header(outcome, reply_dtype, service.num_parameters).SerializeToString()


def _peak(data: memoryview, dtype: int) -> float | None:
    """A float32 payload's max |value| (NaN if one is not finite), measured here on the loop's
    thread rather than on the applier's; None for the other dtypes (the core measures them)."""
    return max_abs(np.frombuffer(data, np.float32)) if dtype == FLOAT32 else None
