"""The gRPC transport: one channel to one server process, one attempt per call.

The calls that carry θ send and receive bytes that `gemps.grpc_messages` frames and reads without
copies; past STREAM_THRESHOLD_BYTES they go in pieces (CommitStream, PullStream, RegisterStream).
Every grpc.RpcError becomes a typed GempsError here; retries are the session's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import grpc

from gemps import errors
from gemps import grpc_messages as messages
from gemps.channel_security import ChannelSecurity
from gemps.records import Evaluation, Layout, Registration, ServerStatus
from gemps.transport import CommitCall, Committed, Enrolment, PullCall, Pulled, Registered, refuse_non_finite, time_left
from gemps_proto import schema_proto as shared
from gemps_proto import vectors
from gemps_proto.grpc_framing import PayloadAssembler, data_frames, read_data
from gemps_proto.reasons import Reason
from gemps_proto.tensor_codec import EncodedTensor, expected_nbytes, expected_payload_nbytes
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_proto.vectors import Vector

T = TypeVar("T")
ChunkMessage = TypeVar("ChunkMessage", pb.CommitResponseChunk, pb.PullResponseChunk)

# Payloads past this many bytes go through CommitStream (and θ through PullStream) by default:
# the server holds a few θ-sized buffers for streams however many clients commit at once, where
# every unary commit in flight holds its request and its reply (1M parameters, 100 clients:
# 2.1 GB against 0.9 GB); gRPC Python's synchronous client reads a large unary reply slowly (at
# 10M parameters, half the rate of the same reply in pieces); past 2 GiB one message cannot carry
# it. docs/PERFORMANCE.md has the measurements.
STREAM_THRESHOLD_BYTES = 1 << 20
_METHOD = "/gemps.v1.ParameterServer/"
# How soon a disconnected channel tries the server again (gRPC's default grows to 120 s).
RECONNECT_BACKOFF_MS = (200, 2000)  # initial, max
# While a call is in progress, ping the server this often and give up on the connection when a
# ping is not answered this soon: a server whose machine died (or whose cable was cut) sends
# nothing, not even a reset, and the call would wait out its whole deadline (60 s by default)
# before the client tried another replica. The server accepts pings this often (app.py).
KEEPALIVE_MS = (2000, 3000)  # interval, timeout


def _raw(data: bytes) -> bytes:
    return data


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    """Raise a grpc error as the matching GempsError subclass."""
    try:
        yield
    except grpc.RpcError as rpc_error:
        raise errors.from_rpc_error(rpc_error) from None


class _Started(Generic[T]):
    """A call in flight (a gRPC future or stream): `result()` reads its reply."""

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish = finish

    def result(self) -> T:
        with _typed_errors():
            return self._finish()


class GrpcTransport:
    """A channel to one server process (all of θ, or one partition of it) and its calls.

    `streaming` picks unary calls or streams: "auto" streams θ-sized messages past
    STREAM_THRESHOLD_BYTES in pieces of `chunk_bytes`; "always"; "never". `timeout` bounds each
    attempt, and the call's deadline, when one is set (the Client's), bounds them all."""

    plane = "grpc"  # how its commits and pulls travel (gemps.Client.planes)

    def __init__(
        self,
        target: str,
        security: ChannelSecurity,
        *,
        max_message_bytes: int,
        timeout: float,
        wire_dtype: int,
        streaming: str = "auto",
        chunk_bytes: int,
    ) -> None:
        self._target = target
        self.timeout = timeout
        self.wire_dtype = wire_dtype
        self.streaming = streaming
        self.chunk_bytes = chunk_bytes
        self.metadata = security.metadata
        self._security = security
        self._options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS[0]),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS[1]),
            ("grpc.keepalive_permit_without_calls", 0),  # an idle connection stays silent
            ("grpc.http2.max_pings_without_data", 0),  # a call waiting for its reply sends no data
        ]
        self._open_channel()

    def _open_channel(self) -> None:
        """A new channel to the server (its connection made by the first call) and the calls on it."""
        self.channel = self._security.channel(self._target, options=self._options)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self._register = self.channel.unary_unary(_METHOD + "Register", _raw, _raw)
        self._register_stream = self.channel.stream_unary(_METHOD + "RegisterStream", _raw, _raw)
        self._pull = self.channel.unary_unary(_METHOD + "Pull", _raw, _raw)
        self._pull_stream = self.channel.unary_stream(_METHOD + "PullStream", _raw, _raw)
        self._commit = self.channel.unary_unary(_METHOD + "Commit", _raw, _raw)
        self._commit_stream = self.channel.stream_stream(_METHOD + "CommitStream", _raw, _raw)

    @property
    def target(self) -> str:
        return self._target

    def deadline(self) -> float:
        """An attempt's gRPC deadline: `timeout`, or what is left of the call's when that is sooner
        (gemps.transport.time_left: the Client's `timeout` bounds the whole call)."""
        return time_left(self.timeout)

    def streams(self, nbytes: int) -> bool:
        """Whether θ-sized messages of `nbytes` go in pieces (CommitStream, PullStream)."""
        return self.streaming == "always" or (self.streaming == "auto" and nbytes > STREAM_THRESHOLD_BYTES)

    # -- Register --------------------------------------------------------------------------------

    def register(self, enrolment: Enrolment, known_history: str) -> Registered:
        """Register with this server. Large models first without the initial values: only the
        first worker of a server needs to send them; 100 workers registering at once would
        otherwise send 100 copies of P floats, and receive 100 more: θ comes by PullStream."""
        values, buffers = enrolment.values, enrolment.buffers
        nbytes = values.nbytes + (buffers.nbytes if buffers is not None else 0)
        if nbytes <= STREAM_THRESHOLD_BYTES:
            return self._send_register(enrolment, values)
        streamed = self.streams(nbytes)
        try:
            registered = self._send_register(enrolment, None, omit_parameters=streamed)
        except errors.GempsError as error:
            if error.reason != Reason.NOT_INITIALIZED:
                raise
            # Ours initialise θ, unless another worker's got there first; streamed, in pieces:
            # the server accepts messages of --max-message-mb at most.
            registered = self._send_register(enrolment, values, omit_parameters=streamed, streamed=streamed)
        registration = registered.registration
        if not streamed or registration.initialized_central:
            return registered
        # θ is another worker's: read it in pieces.
        pulled = self.pull(PullCall(registration.worker_id, -1, known_history, _held_size(values, registration.layout)))
        assert pulled.parameters is not None
        buffers_now = pulled.buffers if pulled.buffers is not None else registered.buffers
        return Registered(registration, pulled.parameters, buffers_now, pulled.version, pulled.history)

    def _send_register(
        self, enrolment: Enrolment, values: Vector | None, omit_parameters: bool = False, streamed: bool = False
    ) -> Registered:
        request = messages.register_request(
            enrolment.spec,
            enrolment.worker_name,
            values,
            omit_parameters=omit_parameters,
            buffer_spec=enrolment.buffer_spec,
            buffers=enrolment.buffers if values is not None else None,  # with θ's, or not at all
            client_id=enrolment.client_id,
            job=enrolment.job,
            streamed=streamed,
        )
        with _typed_errors():
            if not streamed:
                reply = self._register(request, timeout=self.deadline(), metadata=self.metadata)
            else:
                assert values is not None
                parts = messages.register_stream_data(values, enrolment.buffer_spec, enrolment.buffers)
                frames = itertools.chain((request,), *(data_frames(part, self.chunk_bytes) for part in parts))
                reply = self._register_stream(frames, timeout=self.deadline(), metadata=self.metadata)
        registered = messages.register_reply(reply)
        refusal = errors.incompatible_server(self.target, registered.registration.versions)
        if refusal is not None:  # a server that registered us anyway: leave it as we found it
            with contextlib.suppress(errors.GempsError):
                self.leave(registered.registration.worker_id)
            raise refusal
        return registered

    # -- Pull --------------------------------------------------------------------------------------

    def start_pull(self, call: PullCall) -> _Started[Pulled]:
        return self._pull_call(call, blocking=False)

    def pull(self, call: PullCall) -> Pulled:
        return self._pull_call(call, blocking=True).result()

    def _pull_call(self, call: PullCall, blocking: bool) -> _Started[Pulled]:
        request, streamed = self._pull_request(call)
        with _typed_errors():
            if streamed:
                replies = iter(self._pull_stream(request, timeout=self.deadline(), metadata=self.metadata))
                return _Started(lambda: _read_pull_stream(replies))
            return self._unary(self._pull, request, messages.pull_reply, blocking)

    def _pull_request(self, call: PullCall) -> tuple[bytes, bool]:
        """A Pull of one server's slice, and whether it goes by PullStream."""
        request = messages.pull_request(call, self.wire_dtype)
        return request, self.streams(expected_nbytes(self.wire_dtype, [call.size]))

    # -- Commit ----------------------------------------------------------------------------------

    def start_commit(self, call: CommitCall) -> _Started[Committed]:
        return self._commit_call(call, blocking=False)

    def commit(self, call: CommitCall) -> Committed:
        return self._commit_call(call, blocking=True).result()

    def _commit_call(self, call: CommitCall, blocking: bool) -> _Started[Committed]:
        header, data, streamed = self._commit_request(call)
        with _typed_errors():
            if streamed:
                replies = self._start_commit_stream(header, data)
                return _Started(lambda: _read_commit_stream(replies))
            return self._unary(self._commit, header, messages.commit_reply, blocking)

    def _commit_request(self, call: CommitCall) -> tuple[bytes, bytes | memoryview, bool]:
        """The Commit header, the payload's wire bytes, and whether they go by CommitStream."""
        if call.check_finite:
            refuse_non_finite("payload", call.payload)
        dtype, data = call.wire(self.wire_dtype)  # float32: a view, not a copy
        streamed = self.streams(len(data))
        header = messages.commit_request(call, self.wire_dtype, dtype, data, streamed=streamed)
        return header, data, streamed

    def _start_commit_stream(self, header: bytes, data: bytes | memoryview) -> Iterator[bytes]:
        """A CommitStream: the header, the payload in pieces; the reply likewise."""
        frames = itertools.chain((header,), data_frames(data, self.chunk_bytes))
        return iter(self._commit_stream(frames, timeout=self.deadline(), metadata=self.metadata))

    def _unary(
        self,
        method: grpc.UnaryUnaryMultiCallable[bytes, bytes],
        request: bytes,
        read: Callable[[bytes], T],
        blocking: bool,
    ) -> _Started[T]:
        """A unary call, started; made at once when the caller waits for it at once (`blocking`):
        gRPC's blocking call reads the reply on the calling thread, where its future's reply comes
        through the channel's own thread (100K parameters, one client: 0.97, 0.97, 0.81, 0.71 ms
        of client CPU per commit blocking against 1.31, 1.34, 1.13, 1.15 through the future)."""
        if blocking:
            reply = method(request, timeout=self.deadline(), metadata=self.metadata)
            return _Started(lambda: read(reply))
        future = method.future(request, timeout=self.deadline(), metadata=self.metadata)
        return _Started(lambda: read(future.result()))

    # -- the small calls -------------------------------------------------------------------------

    def leave(self, worker_id: str) -> None:
        with _typed_errors():
            self.stub.Leave(pb.LeaveRequest(worker_id=worker_id), timeout=self.deadline(), metadata=self.metadata)

    def status(self) -> ServerStatus:
        with _typed_errors():
            reply = self.stub.Status(pb.StatusRequest(), timeout=self.deadline(), metadata=self.metadata)
        status = shared.status_from_proto(reply)
        refusal = errors.incompatible_server(self.target, status.versions)
        if refusal is not None:
            raise refusal
        return status

    def resume(self, registration: Registration) -> None:
        """Nothing to take: every gRPC call carries its worker id."""

    def report_evaluation(self, evaluation: Evaluation) -> None:
        report = shared.evaluation_to_proto(evaluation)
        with _typed_errors():
            self.stub.ReportEvaluation(report, timeout=self.deadline(), metadata=self.metadata)

    def interrupt(self) -> None:
        """End every call in flight (CANCELLED: its channel closed); the next call goes on a new
        channel, a new connection (the session may stay with this server: issue 77)."""
        woken = self.channel
        self._open_channel()
        woken.close()

    def close(self) -> None:
        self.channel.close()


def _held_size(values: Vector, layout: Layout | None) -> int:
    """How many values a server holds: its own partition's, else all that were registered."""
    return vectors.size(values) if layout is None else layout.partitions[layout.index].size


def _read_pull_stream(replies: Iterator[bytes]) -> Pulled:
    """A PullStream's reply: the header, then (unless unchanged) θ in pieces."""
    header = pb.PullResponseChunk.FromString(next(replies)).header
    if header.unchanged:
        return messages.pulled_from_proto(header, None)
    return messages.pulled_from_proto(header, _read_pieces(header.parameters, replies, pb.PullResponseChunk).decode())


def _read_commit_stream(replies: Iterator[bytes]) -> Committed:
    header = pb.CommitResponseChunk.FromString(next(replies)).header
    if header.unchanged:  # θ as the call said it holds: no pieces follow
        return messages.committed_from_proto(header, None)
    parameters = _read_pieces(header.parameters, replies, pb.CommitResponseChunk)
    return messages.committed_from_proto(header, messages.reply_values(header, parameters))


def _read_pieces(parameters: pb.Tensor, replies: Iterator[bytes], chunk_class: type[ChunkMessage]) -> EncodedTensor:
    """A streamed reply's θ (or difference): the data pieces after its header, which announced
    dtype and shape."""
    assembler = PayloadAssembler(expected_payload_nbytes(parameters.dtype, parameters.shape))
    for message in replies:
        piece = read_data(message)
        assembler.add(piece if piece is not None else chunk_class.FromString(message).data)
    return EncodedTensor(parameters.dtype, tuple(parameters.shape), assembler.result())
