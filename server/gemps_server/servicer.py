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

from gemps_proto.codec import bytes_to_tensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.applier import Applier
from gemps_server.config import ServerConfig
from gemps_server.errors import REASON_METADATA_KEY, InvalidArgument, ServiceError
from gemps_server.metrics import ServerMetrics
from gemps_server.state import ServerState, parse_spec

log = logging.getLogger("gemps.server")

Request = TypeVar("Request")
Response = TypeVar("Response")
Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Request, Context], Awaitable[Response]]


def maps_service_errors(handler: Handler[Request, Response]) -> Handler[Request, Response]:
    """The one place where ServiceError becomes a gRPC status code and message."""

    @functools.wraps(handler)
    async def wrapper(self: ParameterServerServicer, request: Request, context: Context) -> Response:
        try:
            return await handler(self, request, context)
        except ServiceError as error:
            self.on_rejected(handler.__name__, error)
            await context.abort(error.code, error.message, trailing_metadata=((REASON_METADATA_KEY, error.reason),))
            raise  # unreachable: abort raises

    return wrapper


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
    def __init__(self, config: ServerConfig, state: ServerState, applier: Applier, metrics: ServerMetrics) -> None:
        self._config = config
        self._state = state
        self._applier = applier
        self._metrics = metrics
        self._started = time.monotonic()
        self.commits_rejected = 0
        self.last_evaluation: pb.EvaluationReport | None = None

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
        log.info("rejected %s: code=%s reason=%s: %s", method, error.code.name, error.reason, error.message)

    @maps_service_errors
    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        spec = parse_spec(request.spec)
        initial = request.initial_parameters if request.HasField("initial_parameters") else None
        state = self._state
        registration = await self._applier.submit(lambda: state.register(request.worker_name, spec, initial))
        worker = registration.worker
        self._metrics.active_workers.set(len(state.registry))
        log.info(
            "worker joined: id=%s name=%s shard=%d active=%d version=%d",
            worker.worker_id,
            worker.name or "-",
            worker.slot,
            len(state.registry),
            registration.snapshot.version,
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
        outcome = await self._applier.submit(
            lambda: state.commit(request.worker_id, request.base_version, request.kind, request.payload)
        )
        loss = request.loss if request.HasField("loss") and math.isfinite(request.loss) else None
        self._metrics.applied(outcome.staleness, outcome.stats, outcome.snapshot.version, loss)
        return pb.CommitResponse(
            version=outcome.snapshot.version,
            parameters=bytes_to_tensor(outcome.snapshot.data, state.num_parameters),
            staleness=outcome.staleness,
            scaling_mean=outcome.stats.scaling_mean,
        )

    @maps_service_errors
    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveResponse:
        state = self._state
        worker = await self._applier.submit(lambda: state.leave(request.worker_id))
        self._metrics.active_workers.set(len(state.registry))
        log.info(
            "worker left: id=%s name=%s commits=%d active=%d",
            worker.worker_id,
            worker.name or "-",
            worker.commits,
            len(state.registry),
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
        self._metrics.evaluated(request.version, request.loss, request.accuracy)
        log.info(
            "evaluation: version=%d held_out_loss=%.4f held_out_accuracy=%.4f samples=%d dataset=%s",
            request.version,
            request.loss,
            request.accuracy,
            request.num_samples,
            request.dataset or "-",
        )
        return pb.ReportEvaluationResponse()

    async def evict_expired(self) -> None:
        state = self._state
        for worker in await self._applier.submit(state.evict_expired):
            log.info(
                "worker evicted: id=%s name=%s lease_ttl=%gs commits=%d",
                worker.worker_id,
                worker.name or "-",
                self._config.lease_ttl,
                worker.commits,
            )
        self._metrics.active_workers.set(len(state.registry))
