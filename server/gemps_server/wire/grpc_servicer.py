"""The gRPC servicer: transport, conversion (messages.py) and error mapping, nothing else.

Each RPC parses its request into domain records, asks the service (service.py, the one door to
the domain) to do the work and frames the result as the reply. Client streams are assembled by
streams.py; replies carrying θ hold the reply budget (reply_budget.py) until they are sent.
ServiceError becomes a gRPC status here and only here, and every RPC is timed here, once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from gemps_proto import reasons
from gemps_proto import schema_proto as shared
from gemps_proto.grpc_framing import COMMIT_PAYLOAD_FIELD, REGISTER_INITIAL_FIELD, data_frames
from gemps_proto.schema import ParameterSpec
from gemps_proto.tensor_codec import EncodedBuffers, EncodedTensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.commit_frame import commit_from_proto, reply_dtype_from_proto
from gemps_server.domain.applier import ApplierStopped
from gemps_server.domain.errors import ServiceError
from gemps_server.domain.records import Snapshot
from gemps_server.metrics import ServerMetrics
from gemps_server.security import call_certificates
from gemps_server.service import ParameterService
from gemps_server.wire import messages, streams
from gemps_server.wire.messages import MalformedRequest, WithTensor
from gemps_server.wire.reply_budget import ReplyBudget
from gemps_server.wire.status_codes import internal, status_of
from gemps_server.wire.stream_buffers import BufferPool
from gemps_server.wire.streams import CHUNK_CLASSES, Chunk, Pace
from gemps_server.wire.worker_certificates import WorkerCertificates

F = TypeVar("F", bound=Callable[..., Any])
Context = grpc.aio.ServicerContext[Any, Any]


# Requests whose θ-sized tensor field is read without copying (messages.parse_with_tensor).
TENSOR_FIELDS = {"Commit": COMMIT_PAYLOAD_FIELD, "Register": REGISTER_INITIAL_FIELD}


def _request_parser(
    message_class: type[Message], tensor_field: int | None, on_bytes: Callable[[int], None]
) -> Callable[[bytes], Message | WithTensor[Any] | MalformedRequest]:
    """Parses a request; `on_bytes` is told its size (protobuf's ByteSize on a large message costs
    a serialization)."""

    def parse(data: bytes) -> Message | WithTensor[Any] | MalformedRequest:
        on_bytes(len(data))
        if tensor_field is not None:
            return messages.parse_with_tensor(message_class, tensor_field, data)
        return messages.parse_request(message_class, data)

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
        received = functools.partial(metrics.message_received, method.name, plane="grpc")
        sent = _metered_serializer(functools.partial(metrics.message_sent, method.name, plane="grpc"))
        behaviour = getattr(servicer, method.name)
        if method.client_streaming:  # CommitStream, RegisterStream
            make_handler = (
                grpc.stream_stream_rpc_method_handler
                if method.server_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            parse_chunk = streams.chunk_parser(CHUNK_CLASSES[method.name], received)
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


# Not bugs: a call ended by gRPC itself, or by the server stopping (the client retries elsewhere or later).
STOPPING = (grpc.aio.AbortError, ApplierStopped)


def rpc(handler: F) -> F:
    """Times the RPC and turns a ServiceError (or a malformed request) into its gRPC status, with
    the reason in trailing metadata: the one place where refusals become status codes. Any other
    exception is a bug: INTERNAL, reason `internal`, logged with its traceback."""
    method = handler.__name__

    def refuse(self: GempsServicer, error: ServiceError, context: Context) -> None:
        """Set the refusal's status on the call, which then ends without a reply.

        Not `context.abort()`: the AbortError it raises carries this error as its context, and
        through their tracebacks the frames holding the request, in reference cycles that only
        the cyclic garbage collector frees, much later. Refused requests of up to
        --max-message-mb then stayed resident (issue 15, item 8). Dropping the traceback and
        raising nothing frees the request as soon as the call ends."""
        error.__traceback__ = None
        code = status_of(error)
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
            except STOPPING:
                raise
            except Exception as failure:  # a bug: INTERNAL, not gRPC's UNKNOWN without a reason
                refuse(self, internal(method, failure), context)
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
        except STOPPING:
            raise
        except Exception as failure:  # a bug: INTERNAL, not gRPC's UNKNOWN without a reason
            refuse(self, internal(method, failure), context)
            return None
        finally:
            self.metrics.rpc(method, time.perf_counter() - started)

    return unary  # type: ignore[return-value]


class GempsServicer(pb_grpc.ParameterServerServicer):
    def __init__(
        self,
        service: ParameterService,
        metrics: ServerMetrics,
        max_streamed_payloads: int,
        pace: Pace,
        reply_budget_bytes: int,
        certificates: WorkerCertificates | None = None,
    ) -> None:
        self.service = service
        # With --tls-crl: each registration's certificate, for the data plane's local socket.
        self._certificates = certificates
        self.metrics = metrics
        # Replies carrying θ that gRPC holds until their client reads them (reply_budget.py).
        self._replies = ReplyBudget(reply_budget_bytes)
        # A stream that stops sending or falls behind is refused: it may hold a buffer or the upload.
        self._pace = pace
        # CommitStreams in progress at once (receiving, applying or replying), each in a buffer
        # of about 4P bytes; the rest wait in gRPC flow control, not in this process, and are
        # served in arrival order (asyncio's semaphore is first come, first served).
        self._stream_buffers = BufferPool(max_streamed_payloads)
        # One upload of initial values at a time (RegisterStream): only the first is ever used.
        # Others wait in arrival order (asyncio's lock is first come, first served) for at most
        # as long as the uploads ahead of them may take, each bounded by the pace.
        self._initial_upload = asyncio.Lock()

    def _known_version(self, request: pb.PullRequest) -> int:
        """The version the caller holds, if it counts in this server's history; else -1 (none)."""
        return request.known_version if request.known_history == self.service.history else -1

    async def _hold_reply(self, context: Context) -> None:
        """Take a reply of θ (float32 at most) from the budget until this call is over: sent,
        refused, cancelled, or dropped with its connection."""
        nbytes = 4 * self.service.num_parameters
        await self._replies.take(nbytes)
        # (the stub types the callback as a class of its own; any callable of the context works)
        context.add_done_callback(lambda _context: self._replies.give_back(nbytes))  # type: ignore[arg-type]

    async def _pull(self, request: pb.PullRequest, context: Context) -> tuple[Snapshot, bool]:
        """The snapshot a Pull replies with, and whether it is unchanged for the caller; a reply
        with θ holds its budget first (before the snapshot is taken: waiting pins no version)."""
        known = self._known_version(request)
        held = not self.service.unchanged(known)
        if held:
            await self._hold_reply(context)
        dtype = reply_dtype_from_proto(request.reply_dtype)
        snapshot = await self.service.pull(request.worker_id, known, dtype, request.wait_seconds)
        unchanged = self.service.unchanged(known, snapshot.version)
        if not unchanged and not held:  # the version moved since the check above
            await self._hold_reply(context)
        return snapshot, unchanged

    # Replies carrying θ are returned serialized (bytes): see messages.with_parameters.

    @rpc
    async def Register(  # type: ignore[override]
        self, received: WithTensor[pb.RegisterRequest], context: Context
    ) -> bytes:
        request = received.message
        messages.check_client_versions(request)
        spec = messages.spec_from_proto(request.spec)
        buffer_spec, initial_buffers = messages.buffers_from_proto(request)
        return await self._register(request, spec, received.tensor, buffer_spec, initial_buffers, context)

    @rpc
    async def RegisterStream(  # type: ignore[override]
        self, requests: AsyncIterator[Chunk], context: Context
    ) -> bytes:
        """Register with the initial values in pieces (see RegisterChunk). They are read only when
        they initialise θ, one upload at a time, into a buffer of the size the header announced
        once the spec has said that size is right."""
        header = await streams.stream_header(requests, self._pace.idle_timeout, pb.RegisterChunk)
        messages.check_client_versions(header)
        spec = messages.spec_from_proto(header.spec)
        buffer_spec = messages.buffer_spec_from_proto(header.buffer_spec)
        self.service.require_primary()  # before a backup takes (or waits for) an upload of initial values
        if self.service.initialized or not header.HasField("initial_parameters"):
            return await self._register(header, spec, None, buffer_spec, None, context)
        async with self._initial_upload:  # the first worker's: others wait, then find θ initialised
            initial: tuple[EncodedTensor | None, EncodedBuffers | None] = (None, None)
            if not self.service.initialized:
                check = functools.partial(self.service.check_upload, spec, buffer_spec)
                try:
                    initial = await streams.receive_initial_values(header, requests, self._pace, check)
                except BaseException:  # refused, stalled, or the client gave up (cancelled)
                    self.service.initial_upload_failed()
                    raise
            return await self._register(header, spec, initial[0], buffer_spec, initial[1], context)

    async def _register(
        self,
        request: pb.RegisterRequest,
        spec: tuple[ParameterSpec, ...],
        initial: EncodedTensor | None,
        buffer_spec: tuple[ParameterSpec, ...],
        initial_buffers: EncodedBuffers | None,
        context: Context,
    ) -> bytes:
        include = not request.omit_parameters
        if include and self.service.initialized:
            await self._hold_reply(context)
        registered, registration = await self.service.register(
            request.worker_name, spec, initial, include, buffer_spec, initial_buffers, request.client_id, request.job
        )
        if self._certificates is not None:
            self._certificates.registered(registration.worker_id, call_certificates(context))
        return messages.registered_to_proto(
            registered,
            registration,
            self.service.num_parameters,
            include_parameters=include,
            history=self.service.history,
        )

    @rpc
    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.PullResponse | bytes:  # type: ignore[override]
        reply_dtype = reply_dtype_from_proto(request.reply_dtype)
        snapshot, unchanged = await self._pull(request, context)
        if unchanged:
            takes_next = self.service.round_takes_next(request.worker_id)
            return messages.unchanged_to_proto(snapshot.version, self.service.history, takes_next)
        return messages.pull_to_proto(snapshot, reply_dtype, self.service.num_parameters, self.service.history)

    @rpc
    async def PullStream(  # type: ignore[override]  # also yields pre-framed bytes (gemps_proto.grpc_framing)
        self, request: pb.PullRequest, context: Context
    ) -> AsyncIterator[pb.PullResponseChunk | bytes]:
        """Pull with the parameters in pieces, read from the version's one shared encoding: a
        pull holds no copy of θ of its own, however many run at once."""
        reply_dtype = reply_dtype_from_proto(request.reply_dtype)
        snapshot, unchanged = await self._pull(request, context)
        service = self.service
        yield messages.pull_stream_header_to_proto(
            *(snapshot, unchanged, reply_dtype, service.num_parameters, service.history),
            service.round_takes_next(request.worker_id),
        )
        if not unchanged:
            for frame in data_frames(snapshot.data(reply_dtype) or b""):
                yield frame

    @rpc
    async def Commit(self, received: WithTensor[pb.CommitRequest], context: Context) -> bytes:  # type: ignore[override]
        commit = commit_from_proto(received.message, received.tensor, history=self.service.history)
        await self._hold_reply(context)
        # Framed by the state on the applier, straight from θ at the commit's version.
        _, reply = await self.service.commit(
            commit, messages.commit_reply(commit.reply_dtype, self.service.num_parameters)
        )
        return reply

    @rpc
    async def CommitStream(  # type: ignore[override]  # also yields pre-framed bytes (gemps_proto.grpc_framing)
        self, requests: AsyncIterator[Chunk], context: Context
    ) -> AsyncIterator[pb.CommitResponseChunk | bytes]:
        """Commit with the payload and the reply's parameters in pieces (see CommitChunk)."""
        header = await streams.stream_header(requests, self._pace.idle_timeout, pb.CommitChunk)
        dtype = reply_dtype_from_proto(header.reply_dtype)
        # One pooled buffer per stream: the payload is assembled in it, then the reply's θ is
        # copied into the same bytes. Streams past the pool wait in gRPC flow control.
        async with self._stream_buffers.buffer() as buffer:
            expected = self.service.expected_payload_bytes
            payload = await streams.receive_payload(header, requests, self._pace, buffer, expected)
            commit = commit_from_proto(header, payload, history=self.service.history)
            outcome, data = await self.service.commit(commit, messages.stream_commit_reply(buffer))
            yield messages.stream_header_to_proto(outcome, dtype, self.service.num_parameters)
            for frame in data_frames(data):  # framed as they go: one piece at a time
                yield frame

    @rpc
    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveResponse:
        await self.service.leave(request.worker_id)
        return pb.LeaveResponse()

    @rpc
    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        return shared.status_to_proto(await self.service.status())

    @rpc
    async def ReportEvaluation(self, request: pb.EvaluationReport, context: Context) -> pb.ReportEvaluationResponse:
        self.service.report_evaluation(shared.evaluation_from_proto(request))
        return pb.ReportEvaluationResponse()
