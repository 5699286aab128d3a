"""The gRPC servicer: transport, conversion (serde.py) and error mapping, nothing else.

Each RPC turns its request into domain types, asks the service (service.py) to do the work and
turns the result into the reply. ServiceError becomes a gRPC status here and only here, and
every RPC is timed here, once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, overload

import grpc
from google.protobuf.message import Message

from gemps_proto import reasons
from gemps_proto import serde as shared
from gemps_proto.codec import EncodedTensor, TensorDecodeError, expected_nbytes, num_elements
from gemps_proto.framing import COMMIT_PAYLOAD_FIELD, REGISTER_INITIAL_FIELD, PayloadAssembler, data_frames, read_data
from gemps_proto.reasons import Reason
from gemps_proto.schema import ParameterSpec
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server import serde
from gemps_server.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from gemps_server.metrics import ServerMetrics
from gemps_server.reply_budget import ReplyBudget
from gemps_server.serde import MalformedRequest, WithTensor
from gemps_server.service import ParameterService
from gemps_server.state import CommitOutcome, ServerState, Snapshot
from gemps_server.stream_buffers import Buffer, BufferPool

F = TypeVar("F", bound=Callable[..., Any])
Context = grpc.aio.ServicerContext[Any, Any]
# What a client-streaming RPC's parser hands the handler: a data piece, a header, or undecodable bytes.
ChunkMessage = pb.CommitChunk | pb.RegisterChunk
Chunk = ChunkMessage | memoryview | MalformedRequest
# The request message of each client-streaming RPC: a header, then data pieces.
CHUNK_CLASSES: dict[str, type[ChunkMessage]] = {"CommitStream": pb.CommitChunk, "RegisterStream": pb.RegisterChunk}

#: the gRPC status of each kind of refusal
STATUS_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


# Requests whose θ-sized tensor field is read without copying (serde.parse_with_tensor).
TENSOR_FIELDS = {"Commit": COMMIT_PAYLOAD_FIELD, "Register": REGISTER_INITIAL_FIELD}


def _request_parser(
    message_class: type[Message], tensor_field: int | None, on_bytes: Callable[[int], None]
) -> Callable[[bytes], Message | WithTensor[Any] | MalformedRequest]:
    """Parses a request; `on_bytes` is told its size (protobuf's ByteSize on a large message costs
    a serialization)."""

    def parse(data: bytes) -> Message | WithTensor[Any] | MalformedRequest:
        on_bytes(len(data))
        if tensor_field is not None:
            return serde.parse_with_tensor(message_class, tensor_field, data)
        return serde.parse_request(message_class, data)

    return parse


def _chunk_parser(chunk_class: type[ChunkMessage], on_bytes: Callable[[int], None]) -> Callable[[bytes], Chunk]:
    """A client-streaming RPC's request parser: a data piece comes back as a memoryview of the
    message (no copy), anything else as the protobuf message."""

    def parse(data: bytes) -> Chunk:
        on_bytes(len(data))
        piece = read_data(data)
        return piece if piece is not None else serde.parse_request(chunk_class, data)

    return parse


def _metered_serializer(on_bytes: Callable[[int], None]) -> Callable[[Message | bytes], bytes]:
    """Serializes a reply (bytes are already serialized, e.g. framed data pieces) and tells `on_bytes` its size."""

    def serialize(message: Message | bytes) -> bytes:
        data = message if isinstance(message, bytes) else message.SerializeToString()
        on_bytes(len(data))
        return data

    return serialize


def add_to_server(servicer: GempsServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated add_ParameterServerServicer_to_server, but with
    request parsing that turns undecodable bytes into INVALID_ARGUMENT, and byte metrics."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    metrics = servicer.metrics
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        received = functools.partial(metrics.message_received, method.name)
        sent = _metered_serializer(functools.partial(metrics.message_sent, method.name))
        behaviour = getattr(servicer, method.name)
        if method.client_streaming:  # CommitStream, RegisterStream
            make_handler = (
                grpc.stream_stream_rpc_method_handler
                if method.server_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            parse_chunk = _chunk_parser(CHUNK_CLASSES[method.name], received)
            handlers[method.name] = make_handler(behaviour, request_deserializer=parse_chunk, response_serializer=sent)
            continue
        parse = _request_parser(getattr(pb, method.input_type.name), TENSOR_FIELDS.get(method.name), received)
        if method.server_streaming:  # PullStream
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                behaviour, request_deserializer=parse, response_serializer=sent
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                behaviour, request_deserializer=parse, response_serializer=sent
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def rpc(handler: F) -> F:
    """Times the RPC and turns a ServiceError (or a malformed request) into its gRPC status, with
    the reason in trailing metadata: the one place where refusals become status codes."""
    method = handler.__name__

    def refuse(self: GempsServicer, error: ServiceError, context: Context) -> None:
        """Set the refusal's status on the call, which then ends without a reply.

        Not `context.abort()`: the AbortError it raises carries this error as its context, and
        through their tracebacks the frames holding the request, in reference cycles that only
        the cyclic garbage collector frees, much later. Refused requests of up to
        --max-message-mb then stayed resident (issue 15, item 8). Dropping the traceback and
        raising nothing frees the request as soon as the call ends."""
        error.__traceback__ = None
        code = STATUS_CODES[type(error)]
        self.service.rejected(method, error, code.name)
        context.set_code(code)
        context.set_details(error.message)
        context.set_trailing_metadata(((reasons.METADATA_KEY, error.reason.value),))

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def streaming(self: GempsServicer, requests: Any, context: Context) -> AsyncIterator[Any]:
            started = time.perf_counter()
            try:
                if isinstance(requests, MalformedRequest):  # a unary request (PullStream's) that did not parse
                    raise requests.refusal()
                async for reply in handler(self, requests, context):
                    yield reply
            except ServiceError as error:
                refuse(self, error, context)
            finally:
                self.metrics.rpc(method, time.perf_counter() - started)

        return streaming  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: GempsServicer, request: Any, context: Context) -> Any:
        started = time.perf_counter()
        try:
            if isinstance(request, MalformedRequest):
                raise request.refusal()
            return await handler(self, request, context)
        except ServiceError as error:
            refuse(self, error, context)
            return None  # the status set above is sent; gRPC discards a reply after a refusal
        finally:
            self.metrics.rpc(method, time.perf_counter() - started)

    return unary  # type: ignore[return-value]


class GempsServicer(pb_grpc.ParameterServerServicer):
    def __init__(
        self,
        service: ParameterService,
        metrics: ServerMetrics,
        max_streamed_payloads: int,
        stream_idle_timeout: float,
        reply_budget_bytes: int,
    ) -> None:
        self.service = service
        self.metrics = metrics
        # Replies carrying θ that gRPC holds until their client reads them (reply_budget.py).
        self._replies = ReplyBudget(reply_budget_bytes)
        # A stream that stops sending is refused after this long: it may hold one of the buffers.
        self._idle_timeout = stream_idle_timeout
        # CommitStreams in progress at once (receiving, applying or replying), each in a buffer
        # of about 4P bytes; the rest wait in gRPC flow control, not in this process.
        self._stream_buffers = BufferPool(max_streamed_payloads)
        # One upload of initial values at a time (RegisterStream): only the first is ever used.
        self._initial_upload = asyncio.Lock()

    @property
    def _num_parameters(self) -> int:
        return self.service.state.num_parameters

    @property
    def _history(self) -> str:
        return self.service.state.history

    def _known_version(self, request: pb.PullRequest) -> int:
        """The version the caller holds, if it counts in this server's history; else -1 (none)."""
        return request.known_version if request.known_history == self._history else -1

    async def _hold_reply(self, context: Context) -> None:
        """Take a reply of θ (float32 at most) from the budget until this call is over: sent,
        refused, cancelled, or dropped with its connection."""
        nbytes = 4 * self._num_parameters
        await self._replies.take(nbytes)
        # (the stub types the callback as a class of its own; any callable of the context works)
        context.add_done_callback(lambda _context: self._replies.give_back(nbytes))  # type: ignore[arg-type]

    async def _pull(self, request: pb.PullRequest, context: Context) -> tuple[Snapshot, bool]:
        """The snapshot a Pull replies with, and whether it is unchanged for the caller; a reply
        with θ holds its budget first (before the snapshot is taken: waiting pins no version)."""
        known = self._known_version(request)
        held = known != self.service.state.version
        if held:
            await self._hold_reply(context)
        snapshot = await self.service.pull(request.worker_id, known, serde.reply_dtype_from_proto(request.reply_dtype))
        unchanged = known == snapshot.version
        if not unchanged and not held:  # the version moved since the check above
            await self._hold_reply(context)
        return snapshot, unchanged

    # Replies carrying θ are returned serialized (bytes): see serde.with_parameters.

    @rpc
    async def Register(  # type: ignore[override]
        self, received: WithTensor[pb.RegisterRequest], context: Context
    ) -> bytes:
        request = received.message
        spec = serde.spec_from_proto(request.spec)
        buffer_spec, initial_buffers = serde.buffers_from_proto(request)
        return await self._register(request, spec, received.tensor, buffer_spec, initial_buffers, context)

    @rpc
    async def RegisterStream(  # type: ignore[override]
        self, requests: AsyncIterator[Chunk], context: Context
    ) -> bytes:
        """Register with the initial values in pieces (see RegisterChunk). They are read only when
        they initialise θ, one upload at a time, into a buffer of the size the header announced
        once the spec has said that size is right."""
        header = await _stream_header(requests, self._idle_timeout, pb.RegisterChunk)
        spec = serde.spec_from_proto(header.spec)
        buffer_spec = serde.spec_from_proto(header.buffer_spec)
        if self.service.state.initialized or not header.HasField("initial_parameters"):
            return await self._register(header, spec, None, buffer_spec, None, context)
        async with self._initial_upload:  # the first worker's: others wait, then find θ initialised
            initial: tuple[EncodedTensor | None, EncodedTensor | None] = (None, None)
            if not self.service.state.initialized:
                initial = await self._receive_initial_values(header, spec, buffer_spec, requests)
            return await self._register(header, spec, initial[0], buffer_spec, initial[1], context)

    async def _register(
        self,
        request: pb.RegisterRequest,
        spec: tuple[ParameterSpec, ...],
        initial: EncodedTensor | None,
        buffer_spec: tuple[ParameterSpec, ...],
        initial_buffers: EncodedTensor | None,
        context: Context,
    ) -> bytes:
        include = not request.omit_parameters
        if include and self.service.state.initialized:
            await self._hold_reply(context)
        admission, registration = await self.service.register(
            request.worker_name, spec, initial, include, buffer_spec, initial_buffers, request.client_id
        )
        return serde.admission_to_proto(
            admission, registration, self._num_parameters, include_parameters=include, history=self._history
        )

    async def _receive_initial_values(
        self,
        header: pb.RegisterRequest,
        spec: tuple[ParameterSpec, ...],
        buffer_spec: tuple[ParameterSpec, ...],
        requests: AsyncIterator[Chunk],
    ) -> tuple[EncodedTensor, EncodedTensor | None]:
        """The initial parameters and buffers in the pieces after the header, in that order; their
        sizes are checked against the spec before a byte is buffered."""
        parameters = header.initial_parameters
        buffers = header.initial_buffers if header.HasField("initial_buffers") else None
        parameter_bytes = _announced_bytes(parameters, "initial_parameters")
        buffer_bytes = 0 if buffers is None else _announced_bytes(buffers, "initial_buffers")
        self.service.state.check_upload(
            spec, buffer_spec, num_elements(parameters.shape), None if buffers is None else num_elements(buffers.shape)
        )
        assembler = PayloadAssembler(parameter_bytes + buffer_bytes)
        data = await self._assemble(requests, assembler, "RegisterStream", pb.RegisterChunk)
        initial = EncodedTensor(parameters.dtype, tuple(parameters.shape), data[:parameter_bytes])
        if buffers is None:
            return initial, None
        return initial, EncodedTensor(buffers.dtype, tuple(buffers.shape), data[parameter_bytes:])

    @rpc
    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.PullResponse | bytes:  # type: ignore[override]
        reply_dtype = serde.reply_dtype_from_proto(request.reply_dtype)
        snapshot, unchanged = await self._pull(request, context)
        if unchanged:
            return serde.unchanged_to_proto(snapshot.version, self._history)
        return serde.pull_to_proto(snapshot, reply_dtype, self._num_parameters, self._history)

    @rpc
    async def PullStream(  # type: ignore[override]  # also yields pre-framed bytes (see chunks.py)
        self, request: pb.PullRequest, context: Context
    ) -> AsyncIterator[pb.PullResponseChunk | bytes]:
        """Pull with the parameters in pieces, read from the version's one shared encoding: a
        pull holds no copy of θ of its own, however many run at once."""
        reply_dtype = serde.reply_dtype_from_proto(request.reply_dtype)
        snapshot, unchanged = await self._pull(request, context)
        yield serde.pull_stream_header_to_proto(snapshot, unchanged, reply_dtype, self._num_parameters, self._history)
        if not unchanged:
            for frame in data_frames(snapshot.data(reply_dtype) or b""):
                yield frame

    @rpc
    async def Commit(self, received: WithTensor[pb.CommitRequest], context: Context) -> bytes:  # type: ignore[override]
        commit = serde.commit_from_proto(received.message, received.tensor)
        dtype, size = commit.reply_dtype, self._num_parameters
        await self._hold_reply(context)

        def framed(outcome: CommitOutcome, state: ServerState) -> bytes:  # on the applier: θ is the commit's
            return serde.outcome_to_proto(outcome, dtype, state.theta_wire(dtype), size)

        _, reply = await self.service.commit(commit, framed)
        return reply

    @rpc
    async def CommitStream(  # type: ignore[override]  # also yields pre-framed bytes (see chunks.py)
        self, requests: AsyncIterator[Chunk], context: Context
    ) -> AsyncIterator[pb.CommitResponseChunk | bytes]:
        """Commit with the payload and the reply's parameters in pieces (see CommitChunk)."""
        header = await _stream_header(requests, self._idle_timeout, pb.CommitChunk)
        dtype = serde.reply_dtype_from_proto(header.reply_dtype)
        # One pooled buffer per stream: the payload is assembled in it, then the reply's θ is
        # copied into the same bytes. Streams past the pool wait in gRPC flow control.
        async with self._stream_buffers.buffer() as buffer:
            payload = await self._receive_payload(header, requests, buffer)

            def reply(outcome: CommitOutcome, state: ServerState) -> memoryview:
                # On the applier, while θ is the commit's version; the payload is applied, done with.
                return buffer.copy_in(state.theta_wire(dtype))

            outcome, data = await self.service.commit(serde.commit_from_proto(header, payload), reply)
            yield serde.stream_header_to_proto(outcome, dtype, self._num_parameters)
            for frame in data_frames(data):  # framed as they go: one piece at a time
                yield frame

    async def _receive_payload(
        self, header: pb.CommitRequest, requests: AsyncIterator[Chunk], buffer: Buffer
    ) -> EncodedTensor:
        """The data pieces after the header, checked against the size it announced before any is buffered."""
        shape = tuple(header.payload.shape)
        expected = self.service.state.expected_payload_bytes(header.payload.dtype, shape)
        assembler = PayloadAssembler(expected, into=buffer.take(expected))
        data = await self._assemble(requests, assembler, "CommitStream", pb.CommitChunk)
        return EncodedTensor(header.payload.dtype, shape, data)

    async def _assemble(
        self, requests: AsyncIterator[Chunk], assembler: PayloadAssembler, method: str, chunk_class: type[ChunkMessage]
    ) -> memoryview:
        """The data pieces after a stream's header, into `assembler`; InvalidArgument for anything
        else, or more or fewer bytes than announced; DeadlineExceeded when the client stalls."""
        while (chunk := await _next_piece(requests, self._idle_timeout, method)) is not None:
            if isinstance(chunk, MalformedRequest):
                raise chunk.refusal()
            if isinstance(chunk, chunk_class):
                if chunk.WhichOneof("part") != "data":
                    raise InvalidArgument(f"{method} sent a second header", Reason.MALFORMED)
                chunk = memoryview(chunk.data)
            elif not isinstance(chunk, memoryview):
                raise InvalidArgument(f"{method} sent a {type(chunk).__name__}", Reason.MALFORMED)
            try:
                assembler.add(chunk)
            except ValueError as error:
                raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None
        try:
            return assembler.result()
        except ValueError as error:
            raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None

    @rpc
    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveResponse:
        await self.service.leave(request.worker_id)
        return pb.LeaveResponse()

    @rpc
    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        return shared.status_to_proto(self.service.status())

    @rpc
    async def ReportEvaluation(self, request: pb.EvaluationReport, context: Context) -> pb.ReportEvaluationResponse:
        self.service.report_evaluation(shared.evaluation_from_proto(request))
        return pb.ReportEvaluationResponse()


async def _next_piece(requests: AsyncIterator[Chunk], timeout: float, method: str) -> Chunk | None:
    """The stream's next piece (None at its end); DeadlineExceeded after `timeout` seconds of silence."""
    try:
        return await asyncio.wait_for(anext(requests, None), timeout)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"{method} sent nothing for {timeout:g} s (the server's --stream-idle-timeout)", Reason.STREAM_IDLE
        ) from None


@overload
async def _stream_header(
    requests: AsyncIterator[Chunk], timeout: float, chunk_class: type[pb.CommitChunk]
) -> pb.CommitRequest: ...
@overload
async def _stream_header(
    requests: AsyncIterator[Chunk], timeout: float, chunk_class: type[pb.RegisterChunk]
) -> pb.RegisterRequest: ...
async def _stream_header(
    requests: AsyncIterator[Chunk], timeout: float, chunk_class: type[ChunkMessage]
) -> pb.CommitRequest | pb.RegisterRequest:
    """A client-streaming RPC's first message, its header."""
    method = chunk_class.__name__.removesuffix("Chunk") + "Stream"
    first = await _next_piece(requests, timeout, method)
    if isinstance(first, MalformedRequest):
        raise first.refusal()
    if not isinstance(first, chunk_class) or first.WhichOneof("part") != "header":
        raise InvalidArgument(
            f"{method} must start with a header chunk ({chunk_class.__name__}.header)", Reason.MALFORMED
        )
    return first.header


def _announced_bytes(tensor: pb.Tensor, what: str) -> int:
    """The bytes a streamed tensor's header announces; InvalidArgument for a bad dtype or shape."""
    try:
        return expected_nbytes(tensor.dtype, tuple(tensor.shape))
    except TensorDecodeError as error:
        raise InvalidArgument(f"{what}: {error}", Reason.BAD_PAYLOAD) from None
