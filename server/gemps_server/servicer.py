"""The gRPC servicer: translates messages, submits state changes to the applier, maps errors.

Kept thin on purpose: the rules live in state.py and rules/, ordering in applier.py.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from gemps_proto.codec import bytes_to_tensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.applier import Applier
from gemps_server.config import ServerConfig
from gemps_server.errors import REASON_METADATA_KEY, InvalidArgument, ResourceExhausted, ServiceError
from gemps_server.logs import Throttle, event
from gemps_server.metrics import ServerMetrics
from gemps_server.security import RateLimiter
from gemps_server.state import CommitOutcome, Registration, ServerState, parse_spec

log = logging.getLogger("gemps.server")

Request = TypeVar("Request")
Response = TypeVar("Response")
Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Request, Context], Awaitable[Response]]


class MalformedRequest:
    """Stands in for a request whose bytes are not a valid message of the method's type, so the
    handler can answer INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, message_type: str, size: int, error: str) -> None:
        self.message_type = message_type
        self.size = size
        self.error = error

    def ByteSize(self) -> int:  # the protobuf name: the RPC metrics call it
        return self.size


def lenient_parser(message_class: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    def parse(data: bytes) -> Message | MalformedRequest:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, len(data), str(error))

    return parse


def add_to_server(servicer: ParameterServerServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated add_ParameterServerServicer_to_server, but with
    request parsing that turns undecodable bytes into INVALID_ARGUMENT."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=lenient_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
        for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def maps_service_errors(handler: Handler[Request, Response]) -> Handler[Request, Response]:
    """The one place where ServiceError becomes a gRPC status code and message.

    Also where every RPC is measured: handling time and message bytes in and out, by method.
    """
    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: ParameterServerServicer, request: Request, context: Context) -> Response:
        started = time.perf_counter()
        sent = 0
        try:
            if isinstance(request, MalformedRequest):
                raise InvalidArgument(
                    f"request is not a valid {request.message_type}: {request.error}", reason="malformed"
                )
            response = await handler(self, request, context)
            sent = _message_bytes(response)
            return response
        except ServiceError as error:
            self.on_rejected(method, error)
            await context.abort(error.code, error.message, trailing_metadata=((REASON_METADATA_KEY, error.reason),))
            raise  # unreachable: abort raises
        finally:
            self._metrics.rpc(method, time.perf_counter() - started, _message_bytes(request), sent)

    return wrapper


def _message_bytes(message: object) -> int:
    size = getattr(message, "ByteSize", None)
    return int(size()) if size is not None else 0


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
        self._metrics = metrics
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

    def on_rejected(self, method: str, error: ServiceError) -> None:
        if method == "Commit":
            self.commits_rejected += 1
            self._metrics.rejected(error.reason)
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
            self._metrics.refusal("registration_rate")
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
        self._metrics.registered()
        if initialised:
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
        return pb.RegisterResponse(
            worker_id=worker.worker_id,
            lease_ttl_seconds=self._config.lease_ttl,
            config=self.training_config(),
            shard=pb.Shard(index=worker.slot, count=self._config.num_shards),
            version=registration.snapshot.version,
            parameters=bytes_to_tensor(registration.snapshot.data, state.num_parameters),
        )

    @maps_service_errors
    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.PullResponse:
        state = self._state
        state.require_initialized()
        if request.worker_id:
            state.registry.touch(request.worker_id)
        snapshot = state.snapshot
        if request.known_version == snapshot.version:
            return pb.PullResponse(version=snapshot.version, unchanged=True)
        return pb.PullResponse(
            version=snapshot.version, parameters=bytes_to_tensor(snapshot.data, state.num_parameters)
        )

    @maps_service_errors
    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        state = self._state
        submitted = time.perf_counter()
        started = finished = submitted

        def commit() -> CommitOutcome:
            nonlocal started, finished
            started = time.perf_counter()
            try:
                return state.commit(
                    request.worker_id, request.base_version, request.kind, request.payload, request.request_id
                )
            finally:
                finished = time.perf_counter()

        outcome = await self._applier.submit(commit)
        if outcome.duplicate:
            self._metrics.duplicate()
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
            return self._commit_response(outcome)
        if self._on_committed is not None:
            self._on_committed(outcome.snapshot.version)
        self._metrics.applied(
            outcome.staleness,
            outcome.stats,
            loss=request.loss if request.HasField("loss") else None,
            num_samples=request.num_samples if request.HasField("num_samples") else None,
            queued_seconds=started - submitted,
            apply_seconds=finished - started,
        )
        return self._commit_response(outcome)

    def _commit_response(self, outcome: CommitOutcome) -> pb.CommitResponse:
        return pb.CommitResponse(
            version=outcome.snapshot.version,
            parameters=bytes_to_tensor(outcome.snapshot.data, self._state.num_parameters),
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
        self._metrics.departed("left")
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
        self._metrics.evaluated(request.dataset, request.version, request.loss, request.accuracy)
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
        self._metrics.departed("evicted", len(evicted))
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
