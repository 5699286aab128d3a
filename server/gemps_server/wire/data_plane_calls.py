"""One data-plane connection (gemps_proto/dataplane.py): the HELLO and its ticket, then one
request and its reply at a time, each a Commit or a Pull answered as the gRPC path answers it.

Sizes are checked before the bytes they announce are read: the preamble's header length against
--max-message-mb, a commit's payload length against the dtype and shape its header announces
(service.expected_payload_bytes). A request refused before its payload was read is answered with
an ERROR frame and the connection closed (its unread bytes are never read); one refused after it
was read whole (NaN, unknown worker, base version) leaves the connection usable. A payload lands
in a pooled θ-sized buffer (recv_into); the reply's θ is copied into the same buffer on the
applier while θ holds the commit's version, and sent from there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from google.protobuf.message import DecodeError, Message

from gemps_proto import dataplane, framing
from gemps_proto.codec import EncodedTensor
from gemps_proto.dataplane import REPLY, FrameError, Op, Preamble
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
)
from gemps_server.metrics import ServerMetrics
from gemps_server.service import ParameterService
from gemps_server.wire import messages
from gemps_server.wire.data_plane_io import Channel, Hangup, PeerClosed, Stalled
from gemps_server.wire.status_codes import status_of
from gemps_server.wire.stream_buffers import ThreadBufferPool

M = TypeVar("M", bound=Message)
Request = TypeVar("Request", pb.CommitRequest, pb.PullRequest)
# The slowest a payload or a reply may move, on average, once it started (1 MiB/s: 4 s more for
# a 1M-parameter θ); what it is given on top of --stream-idle-timeout.
MIN_BYTES_PER_SECOND = 1 << 20
# A HELLO is a worker id and a 32-byte ticket: anything larger is not one.
MAX_HELLO_BYTES = 4096
METHODS: dict[int, str] = {Op.COMMIT: "Commit", Op.PULL: "Pull"}
# What a refused HELLO counts as, by its reason (anything else: bad_hello).
HELLO_REFUSALS = {Reason.UNAUTHENTICATED: "unauthenticated", Reason.UNKNOWN_WORKER: "unknown_worker"}


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int  # --max-message-mb
    handshake_timeout: float  # accept to HELLO answered, TLS included
    idle_timeout: float  # between requests (--connection-idle-timeout)
    stream_timeout: float  # without a byte mid-frame or mid-reply (--stream-idle-timeout)


class Unread(Exception):
    """A request refused before its payload was read: answered, then the connection closes."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


def parsed(message_class: type[M], data: bytes | bytearray) -> M:
    try:
        return message_class.FromString(bytes(data))
    except DecodeError as error:
        raise InvalidArgument(
            f"header is not a valid {message_class.DESCRIPTOR.full_name}: {error}", Reason.MALFORMED
        ) from None


def request_of(message_class: type[Request], header: bytearray, worker_id: str) -> Request:
    """The request a frame's header holds, for this connection's worker; Unread otherwise."""
    try:
        request = parsed(message_class, header)
    except ServiceError as error:
        raise Unread(error) from None
    if request.worker_id != worker_id:
        raise Unread(
            Unauthenticated(
                f"this connection serves worker {worker_id!r}, not {request.worker_id!r}", Reason.UNAUTHENTICATED
            )
        )
    return request


class Connection:
    """Serves one accepted connection on its own thread until it ends (`serve`)."""

    def __init__(
        self,
        channel: Channel,
        service: ParameterService,
        metrics: ServerMetrics,
        limits: Limits,
        pool: ThreadBufferPool,
        accepted_at: float,
    ) -> None:
        self.channel = channel
        self._service = service
        self._metrics = metrics
        self._limits = limits
        self._pool = pool
        self._accepted_at = accepted_at
        # Graceful stop: a connection waiting for its next request is closed at once, one in the
        # middle of a request finishes it first (its reply is its acknowledgement).
        self._lock = threading.Lock()
        self._idle = False
        self._stopping = False

    def stop_when_idle(self) -> None:
        with self._lock:
            self._stopping = True
            if self._idle:
                self.channel.shutdown()

    def serve(self) -> None:
        """The HELLO, then requests until the peer leaves, a guard closes it, or the server stops."""
        try:
            worker_id = self.hello()
            while self.request(worker_id):
                pass
        except Hangup as hangup:
            if hangup.reason is not None:
                self._metrics.data_plane_refused(hangup.reason)
        except (PeerClosed, Stalled):
            pass  # nothing was pending: the peer went away (a stall here is past the reply)

    # -- the hello ----------------------------------------------------------------------------

    def hello(self) -> str:
        """Check the first frame, a HELLO with this worker's ticket, before anything else is read:
        the worker id it serves. Hangup otherwise (an ERROR frame sent first where one can be)."""
        deadline = self._accepted_at + self._limits.handshake_timeout
        timeout = self._limits.handshake_timeout
        try:
            start = self.channel.read_bytes(dataplane.PREAMBLE.size, timeout, deadline)
            preamble = self._preamble(start, "bad_hello")
            if preamble.op != Op.HELLO or preamble.payload_bytes or preamble.header_bytes > MAX_HELLO_BYTES:
                self._refuse(InvalidArgument("the first frame must be a HELLO", Reason.MALFORMED), "bad_hello")
            header = self.channel.read_bytes(preamble.header_bytes, timeout, deadline)
        except Stalled:
            raise Hangup("handshake_timeout") from None
        except PeerClosed:
            raise Hangup("bad_hello") from None
        try:
            hello = parsed(pb.DataPlaneHello, header)
            self._service.check_ticket(hello.worker_id, hello.ticket)
        except ServiceError as error:
            if isinstance(error, Unauthenticated):
                self._metrics.refusal(Reason.UNAUTHENTICATED)  # as the gRPC port counts a bad token
            self._refuse(error, HELLO_REFUSALS.get(error.reason, "bad_hello"))
        self._send(Op.HELLO | REPLY, b"")
        return hello.worker_id

    # -- requests ------------------------------------------------------------------------------

    def request(self, worker_id: str) -> bool:
        """Serve one request; False when the connection should end (the server is stopping)."""
        start = bytearray(dataplane.PREAMBLE.size)
        view = memoryview(start)
        with self._lock:
            if self._stopping:
                return False
            self._idle = True
        received = self.channel.received
        try:
            self.channel.read_into(view[:1], self._limits.idle_timeout)
        except Stalled:
            raise Hangup("idle_timeout") from None
        with self._lock:
            self._idle = False
        started = time.perf_counter()
        try:
            self.channel.read_into(view[1:], self._limits.stream_timeout)
            preamble = self._preamble(start, "bad_frame")
            method = METHODS.get(preamble.op)
            if method is None:
                self._refuse(InvalidArgument(f"op {preamble.op:#x} is not a request", Reason.MALFORMED), "bad_frame")
            self._serve(method, worker_id, preamble, started, received)
        except Stalled:
            self._stalled()
        return True

    def _serve(self, method: str, worker_id: str, preamble: Preamble, started: float, received: int) -> None:
        sent = self.channel.sent
        try:
            if preamble.header_bytes > self._limits.max_header_bytes:
                raise Unread(
                    ResourceExhausted(
                        f"header of {preamble.header_bytes} bytes is past --max-message-mb", Reason.TOO_LARGE
                    )
                )
            header = self.channel.read_bytes(preamble.header_bytes, self._limits.stream_timeout)
            if method == "Commit":
                self._commit(worker_id, preamble, header)
            else:
                self._pull(worker_id, preamble, header)
        except Unread as unread:
            self._rejected(method, unread.error)
            self._refuse(unread.error, "refused_unread")
        except ServiceError as error:  # the frame was read whole: the connection stays usable
            self._rejected(method, error)
            self._send_error(error)
        finally:
            self._metrics.rpc(method, time.perf_counter() - started, plane="data")
            self._metrics.message_received(method, self.channel.received - received, plane="data")
            self._metrics.message_sent(method, self.channel.sent - sent, plane="data")

    def _commit(self, worker_id: str, preamble: Preamble, header: bytearray) -> None:
        service = self._service
        request = request_of(pb.CommitRequest, header, worker_id)
        dtype, shape = request.payload.dtype, tuple(request.payload.shape)
        try:
            if request.payload.data:
                raise InvalidArgument("payload data goes after the header, not in it", Reason.BAD_PAYLOAD)
            expected = service.expected_payload_bytes(dtype, shape)
            if preamble.payload_bytes != expected:
                raise InvalidArgument(
                    f"payload of {preamble.payload_bytes} bytes; its dtype and shape make {expected}",
                    Reason.BAD_PAYLOAD,
                )
        except ServiceError as error:
            raise Unread(error) from None
        with self._pool.buffer(lambda: self._stopping) as buffer:
            if buffer is None:  # the server is stopping: closed unanswered, the client retries
                raise Hangup(None)
            data = buffer.take(expected).data  # recv_into lands the payload in the pooled buffer
            self.channel.read_into(data, self._limits.stream_timeout, self._deadline(len(data)))
            commit = messages.commit_from_proto(request, EncodedTensor(dtype, shape, data))
            outcome, theta = service.commit_blocking(commit, messages.stream_commit_reply(buffer))
            reply = messages.outcome_header(outcome)
            framing.announce(reply.parameters, commit.reply_dtype, service.num_parameters)
            self._send(Op.COMMIT | REPLY, reply.SerializeToString(), theta)

    def _pull(self, worker_id: str, preamble: Preamble, header: bytearray) -> None:
        service = self._service
        request = request_of(pb.PullRequest, header, worker_id)
        if preamble.payload_bytes:
            raise Unread(InvalidArgument("a pull carries no payload", Reason.BAD_PAYLOAD))
        known = request.known_version if request.known_history == service.history else -1
        dtype = messages.reply_dtype_from_proto(request.reply_dtype)
        # A slot of the pool, though θ is sent from the version's shared encoding: what replies
        # to slow readers can pin is bounded by the pool, as for commits.
        with self._pool.buffer(lambda: self._stopping) as slot:
            if slot is None:
                raise Hangup(None)
            snapshot = service.pull_blocking(worker_id, known, dtype)
            unchanged = known == snapshot.version
            reply = messages.pull_stream_header_to_proto(
                snapshot, unchanged, dtype, service.num_parameters, service.history
            ).header
            data = b"" if unchanged else snapshot.data(dtype) or b""
            self._send(Op.PULL | REPLY, reply.SerializeToString(), data)

    # -- helpers -------------------------------------------------------------------------------

    def _preamble(self, data: bytearray, refusal: str) -> Preamble:
        try:
            return dataplane.read_preamble(data)
        except FrameError as error:
            self._refuse(InvalidArgument(str(error), Reason.MALFORMED), refusal)

    def _rejected(self, method: str, error: ServiceError) -> None:
        error.__traceback__ = None  # holds the request's frames otherwise (see grpc_servicer.rpc)
        self._service.rejected(method, error, status_of(error).name)

    def _send(self, op: int, header: bytes, payload: bytes | memoryview = b"") -> None:
        deadline = self._deadline(len(memoryview(payload).cast("B")))
        self.channel.write_frame(op, header, payload, self._limits.stream_timeout, deadline)

    def _deadline(self, nbytes: int) -> float:
        """When `nbytes` of payload must have moved: a client that trickles bytes just fast
        enough to beat the stall timeout still gives its pooled buffer back."""
        return time.monotonic() + self._limits.stream_timeout + nbytes / MIN_BYTES_PER_SECOND

    def _send_error(self, error: ServiceError) -> None:
        self._send(Op.ERROR, error_header(error))

    def _refuse(self, error: ServiceError, refusal: str) -> NoReturn:
        """Answer `error` if the peer still listens, then end the connection (counted as `refusal`)."""
        with contextlib.suppress(PeerClosed, Stalled, OSError):
            self._send_error(error)
        raise Hangup(refusal)

    def _stalled(self) -> NoReturn:
        """No byte for --stream-idle-timeout in the middle of a frame or reply: end it."""
        error = DeadlineExceeded(
            f"nothing moved for {self._limits.stream_timeout:g}s in the middle of a frame", Reason.STREAM_IDLE
        )
        self.channel.sock.settimeout(0.0)  # the error is sent only if it fits now: never wait on this peer
        with contextlib.suppress(TimeoutError, OSError):
            self.channel.sock.send(dataplane.frame_start(Op.ERROR, error_header(error)))
        raise Hangup("stream_timeout")


def error_header(error: ServiceError) -> bytes:
    """A refusal as a DataPlaneError: what the gRPC path would have said (code, message, reason)."""
    message = pb.DataPlaneError(code=status_of(error).value[0], message=error.message, reason=error.reason.value)
    return message.SerializeToString()
