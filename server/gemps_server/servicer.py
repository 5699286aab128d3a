"""The gRPC servicer: translates messages, submits state changes to the applier, maps errors.

Kept thin on purpose: the rules live in state.py and rules/, ordering in applier.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, Union

import grpc
from google.protobuf.message import DecodeError, Message

from gemps_proto.allocator import keep_large_allocations_for
from gemps_proto.chunks import PayloadAssembler, data_frames, read_data
from gemps_proto.codec import bytes_to_tensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.applier import Applier
from gemps_server.config import ServerConfig
from gemps_server.errors import REASON_METADATA_KEY, InvalidArgument, ResourceExhausted, ServiceError
from gemps_server.logs import Throttle, event
from gemps_server.metrics import ServerMetrics
from gemps_server.security import RateLimiter
from gemps_server.state import (
    CommitOutcome,
    Registration,
    ServerState,
    WirePayload,
    check_reply_dtype,
    parse_spec,
)

log = logging.getLogger("gemps.server")

Request = TypeVar("Request")
Response = TypeVar("Response")
Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Request, Context], Awaitable[Response]]
# What CommitStream's parser hands the handler: a data piece, a header, or undecodable bytes.
Chunk = Union[pb.CommitChunk, memoryview, "MalformedRequest"]


class MalformedRequest:
    """Stands in for a request whose bytes are not a valid message of the method's type, so the
    handler can answer INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, message_type: str, size: int, error: str) -> None:
        self.message_type = message_type
        self.size = size
        self.error = error

    def ByteSize(self) -> int:  # the protobuf name: the RPC metrics call it
        return self.size


def lenient_parser(
    message_class: type[Message], on_bytes: Callable[[int], None] = lambda size: None
) -> Callable[[bytes], Message | MalformedRequest]:
    """Parses a request; `on_bytes` is told its size (the metrics: protobuf's ByteSize on a large
    message costs a serialization)."""

    def parse(data: bytes) -> Message | MalformedRequest:
        on_bytes(len(data))
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, len(data), str(error))

    return parse


def chunk_parser(on_bytes: Callable[[int], None]) -> Callable[[bytes], pb.CommitChunk | memoryview | MalformedRequest]:
    """CommitStream's request parser: a data piece comes back as a memoryview of the message
    (no copy), anything else as the protobuf message."""
    parse_message = lenient_parser(pb.CommitChunk)

    def parse(data: bytes) -> pb.CommitChunk | memoryview | MalformedRequest:
        on_bytes(len(data))
        piece = read_data(data)
        return piece if piece is not None else parse_message(data)  # type: ignore[return-value]

    return parse


def metered_serializer(on_bytes: Callable[[int], None]) -> Callable[[Message | bytes], bytes]:
    """Serializes a reply (bytes are already serialized, e.g. framed data pieces) and tells `on_bytes` its size."""

    def serialize(message: Message | bytes) -> bytes:
        data = message if isinstance(message, bytes) else message.SerializeToString()
        on_bytes(len(data))
        return data

    return serialize


def add_to_server(servicer: ParameterServerServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated add_ParameterServerServicer_to_server, but with
    request parsing that turns undecodable bytes into INVALID_ARGUMENT, and byte metrics."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    metrics = servicer.metrics
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        received = functools.partial(metrics.message_received, method.name)
        sent = metered_serializer(functools.partial(metrics.message_sent, method.name))
        if method.name == "CommitStream":
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                servicer.CommitStream, request_deserializer=chunk_parser(received), response_serializer=sent
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                getattr(servicer, method.name),
                request_deserializer=lenient_parser(getattr(pb, method.input_type.name), received),
                response_serializer=sent,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def maps_service_errors(handler: Handler[Request, Response]) -> Handler[Request, Response]:
    """The one place where ServiceError becomes a gRPC status code and message (unary RPCs;
    CommitStream does the same through `_abort`). Also times every RPC, by method."""
    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: ParameterServerServicer, request: Request, context: Context) -> Response:
        started = time.perf_counter()
        try:
            if isinstance(request, MalformedRequest):
                raise malformed(request)
            return await handler(self, request, context)
        except ServiceError as error:
            await self._abort(method, error, context)
            raise  # unreachable: abort raises
        finally:
            self.metrics.rpc(method, time.perf_counter() - started)

    return wrapper


def malformed(request: MalformedRequest) -> InvalidArgument:
    return InvalidArgument(f"request is not a valid {request.message_type}: {request.error}", reason="malformed")


def check_evaluation(report: pb.EvaluationReport, current_version: int) -> None:
    if not (math.isfinite(report.loss) and report.loss >= 0):
        raise InvalidArgument(f"held-out loss {report.loss} must be finite and >= 0", reason="bad_evaluation")
    if not 0.0 <= report.accuracy <= 1.0:
        raise InvalidArgument(f"accuracy {report.accuracy} outside [0, 1]", reason="bad_evaluation")
    if report.version > current_version:
        raise InvalidArgument(
            f"evaluated version {report.version} is ahead of the server's version {current_version}",
            reason="bad_evaluation",
        )


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    def __init__(
        self,
        config: ServerConfig,
        state: ServerState,
        applier: Applier,
        metrics: ServerMetrics,
        on_committed: Callable[[int], None] | None = None,
    ) -> None:
        self._config = config
        self._state = state
        self._applier = applier
        self.metrics = metrics
        # CommitStream payloads buffered at once: each costs P values of memory; the rest wait
        # in gRPC flow control, not in this process.
        self._receive_slots = asyncio.Semaphore(config.max_streamed_payloads)
        # Called on the event loop with the new version after each applied commit (checkpoints).
        self._on_committed = on_committed
        self._registrations = RateLimiter(config.max_registrations_per_minute)
        self._started = time.monotonic()
        self.commits_rejected = 0
        self.last_evaluation: pb.EvaluationReport | None = None
        # A misbehaving client can send thousands of bad requests a second: log at most one line
        # per (method, reason) a second, counting the lines left out; the metrics count every one.
        self._rejection_log = Throttle(interval=1.0)

    def training_config(self) -> pb.TrainingConfig:
        c = self._config
        return pb.TrainingConfig(
            rule=c.rule,
            learning_rate=c.learning_rate,
            momentum=c.momentum,
            kappa=c.kappa,
            pi_max=c.pi_max,
            worker_mode=c.worker_mode,
            batch_size=c.batch_size,
        )

    async def _abort(self, method: str, error: ServiceError, context: Context) -> None:
        self.on_rejected(method, error)
        await context.abort(error.code, error.message, trailing_metadata=((REASON_METADATA_KEY, error.reason),))

    def on_rejected(self, method: str, error: ServiceError) -> None:
        if method == "Commit":
            self.commits_rejected += 1
            self.metrics.rejected(error.reason)
        suppressed = self._rejection_log.allow((method, error.reason))
        if suppressed is not None:
            event(
                log,
                "rejected",
                method=method,
                code=error.code.name,
                reason=error.reason,
                detail=error.message,
                suppressed=suppressed,
            )

    @maps_service_errors
    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        if not self._registrations.allow():
            self.metrics.refusal("registration_rate")
            raise ResourceExhausted(
                f"more than {self._config.max_registrations_per_minute} registrations in a minute; retry later "
                "(raise --max-registrations-per-minute)",
                reason="registration_rate",
            )
        spec = parse_spec(request.spec)
        initial = request.initial_parameters if request.HasField("initial_parameters") else None
        state = self._state

        def register() -> tuple[bool, Registration]:
            # Runs on the applier: whether this registration initialised theta is exact here.
            first = not state.initialized
            return first, state.register(request.worker_name, spec, initial)

        initialised, registration = await self._applier.submit(register)
        worker = registration.worker
        self.metrics.registered()
        if initialised:
            keep_large_allocations_for(4 * state.num_parameters)
            event(
                log,
                "central variable initialised",
                parameters=state.num_parameters,
                tensors=len(state.spec),
                worker_id=worker.worker_id,
            )
        event(
            log,
            "worker joined",
            worker_id=worker.worker_id,
            name=worker.name or None,
            shard=worker.slot,
            active=len(state.registry),
            version=registration.snapshot.version,
        )
        theta = registration.snapshot.data()
        return pb.RegisterResponse(
            worker_id=worker.worker_id,
            lease_ttl_seconds=self._config.lease_ttl,
            config=self.training_config(),
            shard=pb.Shard(index=worker.slot, count=self._config.num_shards),
            version=registration.snapshot.version,
            # None for the worker whose initial_parameters became theta: it has them already.
            parameters=None if initialised or theta is None else bytes_to_tensor(theta, state.num_parameters),
        )

    @maps_service_errors
    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.PullResponse:
        state = self._state
        state.require_initialized()
        if request.worker_id:
            state.registry.touch(request.worker_id)
        reply_dtype = check_reply_dtype(request.reply_dtype)
        snapshot = state.snapshot
        if request.known_version == snapshot.version:
            return pb.PullResponse(version=snapshot.version, unchanged=True)
        if snapshot.data(reply_dtype) is None:  # encoded on the applier: theta may be moving
            snapshot = await self._applier.submit(lambda: state.encoded(reply_dtype))
        return pb.PullResponse(
            version=snapshot.version,
            parameters=bytes_to_tensor(snapshot.data(reply_dtype) or b"", state.num_parameters, reply_dtype),
        )

    @maps_service_errors
    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        outcome = await self._apply_commit(request, WirePayload.of(request.payload))
        return self._commit_response(outcome, request.reply_dtype, with_parameters=True)

    async def CommitStream(  # type: ignore[override]  # also yields pre-framed bytes (see chunks.py)
        self, requests: AsyncIterator[Chunk], context: Context
    ) -> AsyncIterator[pb.CommitResponseChunk | bytes]:
        """Commit with the payload and the reply's parameters in pieces (see CommitChunk)."""
        started = time.perf_counter()
        try:
            try:
                header = await self._stream_header(requests)
                # Bounded: the rest wait in gRPC flow control, holding no buffer here.
                async with self._receive_slots:
                    payload = await self._receive_payload(header, requests)
                    outcome = await self._apply_commit(header, payload)
            except ServiceError as error:
                await self._abort("CommitStream", error, context)
                return
            dtype = check_reply_dtype(header.reply_dtype)
            yield pb.CommitResponseChunk(header=self._commit_response(outcome, dtype, with_parameters=False))
            for frame in data_frames(outcome.snapshot.data(dtype) or b""):
                yield frame
        finally:
            self.metrics.rpc("CommitStream", time.perf_counter() - started)

    async def _stream_header(self, requests: AsyncIterator[Chunk]) -> pb.CommitRequest:
        first = await anext(requests, None)
        if isinstance(first, MalformedRequest):
            raise malformed(first)
        if not isinstance(first, pb.CommitChunk) or first.WhichOneof("part") != "header":
            raise InvalidArgument(
                "CommitStream must start with a header chunk (CommitChunk.header)", reason="malformed"
            )
        return first.header

    async def _receive_payload(self, header: pb.CommitRequest, requests: AsyncIterator[Chunk]) -> WirePayload:
        """The data pieces after the header, checked against the size it announced before any is buffered."""
        shape = tuple(header.payload.shape)
        expected = self._state.expected_payload_bytes(header.payload.dtype, shape)
        assembler = PayloadAssembler(expected)
        async for chunk in requests:
            if isinstance(chunk, MalformedRequest):
                raise malformed(chunk)
            if isinstance(chunk, pb.CommitChunk):
                if chunk.WhichOneof("part") != "data":
                    raise InvalidArgument("CommitStream sent a second header", reason="malformed")
                chunk = memoryview(chunk.data)
            try:
                assembler.add(chunk)
            except ValueError as error:
                raise InvalidArgument(f"payload: {error}", reason="bad_payload") from None
        try:
            return WirePayload(header.payload.dtype, shape, assembler.result())
        except ValueError as error:
            raise InvalidArgument(f"payload: {error}", reason="bad_payload") from None

    async def _apply_commit(self, request: pb.CommitRequest, payload: WirePayload) -> CommitOutcome:
        """Submit a commit to the applier; metrics, logs and checkpoints once it is applied."""
        state = self._state
        submitted = time.perf_counter()
        started = finished = submitted

        def commit() -> CommitOutcome:
            nonlocal started, finished
            started = time.perf_counter()
            try:
                return state.commit(
                    request.worker_id,
                    request.base_version,
                    request.kind,
                    payload,
                    request.request_id,
                    request.reply_dtype,
                )
            finally:
                finished = time.perf_counter()

        outcome = await self._applier.submit(commit)
        if outcome.duplicate:
            self.metrics.duplicate()
            suppressed = self._rejection_log.allow(("Commit", "duplicate"))
            if suppressed is not None:
                event(
                    log,
                    "duplicate commit",
                    worker_id=request.worker_id,
                    request_id=request.request_id,
                    version=outcome.snapshot.version,
                    suppressed=suppressed,
                )
            return outcome
        if self._on_committed is not None:
            self._on_committed(outcome.snapshot.version)
        self.metrics.applied(
            outcome.staleness,
            outcome.stats,
            loss=request.loss if request.HasField("loss") else None,
            num_samples=request.num_samples if request.HasField("num_samples") else None,
            queued_seconds=started - submitted,
            apply_seconds=finished - started,
        )
        return outcome

    def _commit_response(self, outcome: CommitOutcome, reply_dtype: int, with_parameters: bool) -> pb.CommitResponse:
        dtype = check_reply_dtype(reply_dtype)
        data = (outcome.snapshot.data(dtype) or b"") if with_parameters else b""
        return pb.CommitResponse(
            version=outcome.snapshot.version,
            parameters=bytes_to_tensor(data, self._state.num_parameters, dtype),
            staleness=outcome.staleness,
            scaling_mean=outcome.stats.scaling_mean,
            scaling_median=outcome.stats.scaling_median,
            scaling_at_zero=outcome.stats.fraction_at_zero,
            scaling_at_max=outcome.stats.fraction_at_max,
        )

    @maps_service_errors
    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveResponse:
        state = self._state
        worker = await self._applier.submit(lambda: state.leave(request.worker_id))
        self.metrics.departed("left")
        event(
            log,
            "worker left",
            worker_id=worker.worker_id,
            name=worker.name or None,
            commits=worker.commits,
            active=len(state.registry),
        )
        return pb.LeaveResponse()

    @maps_service_errors
    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        state = self._state
        return pb.StatusResponse(
            initialized=state.initialized,
            version=state.version,
            active_workers=len(state.registry),
            num_parameters=state.num_parameters,
            config=self.training_config(),
            commits_applied=state.commits_applied,
            commits_rejected=self.commits_rejected,
            spec=[pb.ParameterSpec(name=s.name, shape=s.shape, dtype=pb.DTYPE_FLOAT32) for s in state.spec],
            uptime_seconds=time.monotonic() - self._started,
            last_evaluation=self.last_evaluation,
        )

    @maps_service_errors
    async def ReportEvaluation(self, request: pb.EvaluationReport, context: Context) -> pb.ReportEvaluationResponse:
        check_evaluation(request, self._state.version)
        self.last_evaluation = request
        self.metrics.evaluated(request.dataset, request.version, request.loss, request.accuracy)
        event(
            log,
            "evaluation",
            version=request.version,
            held_out_loss=request.loss,
            held_out_accuracy=request.accuracy,
            samples=request.num_samples,
            dataset=request.dataset or None,
        )
        return pb.ReportEvaluationResponse()

    async def evict_expired(self) -> None:
        state = self._state
        evicted = await self._applier.submit(state.evict_expired)
        self.metrics.departed("evicted", len(evicted))
        for worker in evicted:
            event(
                log,
                "worker evicted",
                level=logging.WARNING,
                worker_id=worker.worker_id,
                name=worker.name or None,
                lease_ttl_seconds=self._config.lease_ttl,
                commits=worker.commits,
                active=len(state.registry),
            )
