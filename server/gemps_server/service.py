"""The parameter service: what each RPC does, in domain terms, between the servicer and the state.

Every state change goes through the applier (one at a time, in arrival order); this is where its
outcome is counted in the metrics, logged, and handed to the checkpoint schedule. Reads that
need no ordering (a current snapshot, Status) are answered here directly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

from gemps_proto.codec import EncodedTensor
from gemps_proto.reasons import Reason
from gemps_proto.schema import (
    Evaluation,
    Layout,
    ParameterSpec,
    Partition,
    Registration,
    ServerStatus,
    Shard,
    partition_bounds,
)
from gemps_server.allocator import tune_for
from gemps_server.applier import Applier
from gemps_server.config import ServerConfig
from gemps_server.errors import InvalidArgument, ResourceExhausted, ServiceError
from gemps_server.logs import Throttle, event
from gemps_server.metrics import ServerMetrics
from gemps_server.security import RateLimiter
from gemps_server.state import (
    Admission,
    Commit,
    CommitOutcome,
    ServerState,
    Snapshot,
    check_name,
    check_reply_dtype,
)
from gemps_server.workers import WorkerRecord

log = logging.getLogger("gemps.server")

R = TypeVar("R")
# Commits of models up to this size (about 0.2 ms of GEM's update) may run on the event loop
# when the applier is idle; larger ones always go to its thread, so the loop keeps serving.
INLINE_MAX_PARAMETERS = 250_000


# The RPCs that commit: a refusal of either counts as a rejected commit (Status, metrics).
COMMIT_METHODS = frozenset({"Commit", "CommitStream"})


def check_evaluation(report: Evaluation, current_version: int) -> None:
    check_name("dataset", report.dataset)
    if not (math.isfinite(report.loss) and report.loss >= 0):
        raise InvalidArgument(f"held-out loss {report.loss} must be finite and >= 0", Reason.BAD_EVALUATION)
    if not 0.0 <= report.accuracy <= 1.0:
        raise InvalidArgument(f"accuracy {report.accuracy} outside [0, 1]", Reason.BAD_EVALUATION)
    if report.version > current_version:
        raise InvalidArgument(
            f"evaluated version {report.version} is ahead of the server's version {current_version}",
            Reason.BAD_EVALUATION,
        )


class ParameterService:
    def __init__(
        self,
        config: ServerConfig,
        state: ServerState,
        applier: Applier,
        metrics: ServerMetrics,
        on_committed: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self._applier = applier
        self._metrics = metrics
        # Called on the event loop with the new version after each applied commit (checkpoints).
        self._on_committed = on_committed
        self._registrations = RateLimiter(config.max_registrations_per_minute)
        self._started = time.monotonic()
        self.commits_rejected = 0
        self.last_evaluation: Evaluation | None = None
        # A misbehaving client can send thousands of bad requests a second: log at most one line
        # per (method, reason) a second, counting the lines left out; the metrics count every one.
        self._rejection_log = Throttle(interval=1.0)

    # -- the RPCs' work ----------------------------------------------------------------------

    async def register(
        self,
        worker_name: str,
        spec: tuple[ParameterSpec, ...],
        initial: EncodedTensor | None,
        include_parameters: bool = True,
        buffer_spec: tuple[ParameterSpec, ...] = (),
        initial_buffers: EncodedTensor | None = None,
        client_id: str = "",
    ) -> tuple[Admission, Registration]:
        """Admit a worker; `include_parameters` False when its reply leaves θ out (it pulls θ next)."""
        if not self._registrations.allow():
            self._metrics.refusal(Reason.REGISTRATION_RATE)
            raise ResourceExhausted(
                f"more than {self.config.max_registrations_per_minute} registrations in a minute; retry later "
                "(raise --max-registrations-per-minute)",
                Reason.REGISTRATION_RATE,
            )
        state = self.state
        admission = await self._applier.submit(
            lambda: state.register(
                worker_name, spec, initial, include_parameters, buffer_spec, initial_buffers, client_id=client_id
            )
        )
        worker = admission.worker
        self._metrics.registered()
        if (displaced := admission.displaced) is not None:
            self._evicted([displaced], reason="server full; no commit for longer than the lease")
        if admission.initialized_theta:
            tune_for(4 * state.num_parameters)
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
            version=admission.snapshot.version,
        )
        registration = Registration(
            worker_id=worker.worker_id,
            lease_ttl_seconds=self.config.lease_ttl,
            config=self.config.training,
            shard=Shard(worker.slot, self.config.num_shards),
            version=admission.snapshot.version,
            initialized_central=admission.initialized_theta,
            layout=self.layout(),
        )
        return admission, registration

    async def pull(self, worker_id: str, known_version: int, reply_dtype: int) -> Snapshot:
        """The current snapshot, encoded in `reply_dtype` unless the caller already has its version."""
        state = self.state
        state.require_initialized()
        if worker_id:
            state.registry.touch(worker_id)
        check_reply_dtype(reply_dtype)
        snapshot = state.snapshot
        if known_version != snapshot.version and snapshot.data(reply_dtype) is None:
            # Encoded on the applier: theta may be moving.
            snapshot = await self._applier.submit(lambda: state.encoded(reply_dtype))
        return snapshot

    async def commit(self, commit: Commit, reply: Callable[[CommitOutcome, ServerState], R]) -> tuple[CommitOutcome, R]:
        """Apply a commit in FIFO order and build its `reply` on the applier right after, while θ
        holds the commit's version (a unary reply is framed straight from it); metrics, logs and
        checkpoints once it is applied."""
        state = self.state

        def apply() -> tuple[CommitOutcome, R]:
            outcome = state.commit(commit)
            return outcome, reply(outcome, state)

        # Small models: applied on the event loop when the applier is idle (see Applier.submit_timed).
        timed = await self._applier.submit_timed(apply, inline=state.num_parameters <= INLINE_MAX_PARAMETERS)
        outcome, built = timed.result
        if outcome.duplicate:
            self._metrics.duplicate()
            suppressed = self._rejection_log.allow(("Commit", "duplicate"))
            if suppressed is not None:
                event(
                    log,
                    "duplicate commit",
                    worker_id=commit.worker_id,
                    request_id=commit.request_id,
                    version=outcome.snapshot.version,
                    suppressed=suppressed,
                )
            return outcome, built
        if self._on_committed is not None:
            self._on_committed(outcome.snapshot.version)
        self._metrics.applied(
            outcome.staleness,
            outcome.stats,
            loss=commit.loss,
            num_samples=commit.num_samples,
            queued_seconds=timed.timing.queued_seconds,
            apply_seconds=timed.timing.run_seconds,
        )
        return outcome, built

    async def leave(self, worker_id: str) -> None:
        state = self.state
        worker = await self._applier.submit(lambda: state.leave(worker_id))
        self._metrics.departed("left")
        event(
            log,
            "worker left",
            worker_id=worker.worker_id,
            name=worker.name or None,
            commits=worker.commits,
            active=len(state.registry),
        )

    def status(self) -> ServerStatus:
        state = self.state
        return ServerStatus(
            initialized=state.initialized,
            version=state.version,
            active_workers=len(state.registry),
            num_parameters=state.num_parameters,
            config=self.config.training,
            commits_applied=state.commits_applied,
            commits_rejected=self.commits_rejected,
            spec=state.spec,
            buffer_spec=state.buffer_spec,
            uptime_seconds=time.monotonic() - self._started,
            last_evaluation=self.last_evaluation,
            learning_rate=state.learning_rate,
            layout=self.layout(),
        )

    def layout(self) -> Layout | None:
        """How θ is partitioned, as this partition announces it (None: this server holds all of θ).
        Ranges are all empty until θ is initialised; addresses are "" where this process was
        not told them (only partition 0 must know: workers learn the layout from it)."""
        config = self.config
        if config.partitions == 1:
            return None
        total = sum(entry.size for entry in self.state.spec)
        addresses = config.partition_address_list() or ("",) * config.partitions
        bounds = partition_bounds(total, config.partitions)
        partitions = tuple(Partition(a, start, stop) for a, (start, stop) in zip(addresses, bounds, strict=True))
        return Layout(config.partition, partitions, total)

    def report_evaluation(self, evaluation: Evaluation) -> None:
        check_evaluation(evaluation, self.state.version)
        self.last_evaluation = evaluation
        self._metrics.evaluated(evaluation.dataset, evaluation.version, evaluation.loss, evaluation.accuracy)
        event(
            log,
            "evaluation",
            version=evaluation.version,
            held_out_loss=evaluation.loss,
            held_out_accuracy=evaluation.accuracy,
            samples=evaluation.num_samples,
            dataset=evaluation.dataset or None,
        )

    # -- housekeeping --------------------------------------------------------------------------

    async def evict_expired(self) -> None:
        """Forget the workers whose lease ran out (the app calls this periodically)."""
        state = self.state
        self._evicted(await self._applier.submit(state.evict_expired), reason="lease expired")

    def _evicted(self, workers: list[WorkerRecord], reason: str) -> None:
        """Count and log workers the server forgot without their leaving."""
        self._metrics.departed("evicted", len(workers))
        for worker in workers:
            event(
                log,
                "worker evicted",
                level=logging.WARNING,
                worker_id=worker.worker_id,
                name=worker.name or None,
                reason=reason,
                lease_ttl_seconds=self.config.lease_ttl,
                commits=worker.commits,
                active=len(self.state.registry),
            )

    def rejected(self, method: str, error: ServiceError, status: str) -> None:
        """Count and log (throttled) a request refused with gRPC status `status`."""
        if method in COMMIT_METHODS:
            self.commits_rejected += 1
            self._metrics.rejected(error.reason)
        suppressed = self._rejection_log.allow((method, error.reason))
        if suppressed is not None:
            event(
                log,
                "rejected",
                method=method,
                code=status,
                reason=error.reason.value,
                detail=error.message,
                suppressed=suppressed,
            )
