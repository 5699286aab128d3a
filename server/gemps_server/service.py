"""The parameter service: what each RPC does, in domain terms; the one door to the domain.

A wire (the gRPC servicer, the data plane) hands it domain records and gets domain records back,
never protobuf messages, and never reaches the state itself. The gRPC servicer calls it from the
event loop (`commit`, `pull`, awaited); the data plane from its own loop's thread (`commit_then`,
`pull_then`, which hand their outcome to a callback): each pair is kept because each of its
callers needs its half (a selector loop without asyncio cannot await; a coroutine should not
block on a callback), and both halves share the state's operation, the applier and the
bookkeeping (`_current`, `_committed`). Every state change goes through the applier (one at a
time, in arrival order); this is where its outcome is counted in the metrics and logged (the
checkpoint schedule hears of it from the commit core itself). Reads that need no ordering (a
current snapshot, Status, what a stream's header must be checked against) are answered here
directly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from gemps_proto.reasons import Reason
from gemps_proto.schema import (
    Evaluation,
    Layout,
    ParameterSpec,
    Registration,
)
from gemps_proto.status import ServerStatus
from gemps_proto.tensor_codec import EncodedBuffers, EncodedTensor, expected_nbytes, expected_payload_nbytes
from gemps_server import worker_events
from gemps_server.allocator import tune_for
from gemps_server.config import ServerConfig
from gemps_server.domain.applier import Applier, Deliver, Timed
from gemps_server.domain.errors import ResourceExhausted, ServiceError
from gemps_server.domain.records import Commit, CommitOutcome, R, RegistrationOutcome, ReplyWriter, Snapshot
from gemps_server.domain.state import ServerState
from gemps_server.domain.validation import check_evaluation, check_pull_wait, check_reply_dtype, check_upload
from gemps_server.domain.workers import WorkerRecord
from gemps_server.logs import event
from gemps_server.metrics import ServerMetrics
from gemps_server.partition_addresses import PartitionAddresses
from gemps_server.refusals import Refusals
from gemps_server.replicas import NO_REPLICAS, Replicas, acknowledged
from gemps_server.security import RateLimiter, Tickets
from gemps_server.service_reads import DataPlaneOffer, partition_layout, server_status
from gemps_server.theta_waits import ThetaWaits

log = logging.getLogger("gemps.server")


# Commits of models up to this size (about 0.2 ms of GEM's update) may run on the event loop
# when the applier is idle; larger ones always go to its thread, so the loop keeps serving.
INLINE_MAX_PARAMETERS = 250_000


class ParameterService:
    def __init__(
        self,
        config: ServerConfig,
        state: ServerState,
        applier: Applier,
        metrics: ServerMetrics,
        replicas: Replicas = NO_REPLICAS,
        tickets: Tickets | None = None,
    ) -> None:
        self.config = config
        # Who may answer and when a commit may be acknowledged (gemps_server.replicas): the one
        # thing the service knows of replication.
        self._replicas = replicas
        self._state = state
        self._applier = applier
        self._metrics = metrics
        # Registrations carry a ticket once the data plane listens; its key is shared with
        # replication when replicated (its partition's one key).
        self.data_plane = DataPlaneOffer(tickets or Tickets())
        self._registrations = RateLimiter(config.max_registrations_per_minute)
        self._started = time.monotonic()
        self._addresses = PartitionAddresses(config.partition_addresses, config.partitions)
        self.last_evaluation: Evaluation | None = None
        self._refusals = Refusals(metrics)  # counted and logged, throttled
        self.rejected = self._refusals.rejected
        # Pulls held until θ moves (PullRequest.wait_seconds): half the concurrent calls at most.
        self.waits = ThetaWaits(limit=config.max_concurrent_rpcs // 2)

    # -- what the wire reads (no ordering needed: the event loop reads, the applier writes) -----

    @property
    def initialized(self) -> bool:
        """Whether θ holds values (the first worker registered, or a checkpoint was restored)."""
        return self._state.core.initialized

    def initial_upload_failed(self) -> None:
        """The first worker's upload of θ's initial values broke off (refused, stalled, its client
        gone): the next worker to register is asked for its values at once, instead of every other
        worker being told to wait (`initializing`) for the rest of the grace period."""
        self._state.release_initializer()

    def check_upload(
        self,
        spec: Sequence[ParameterSpec],
        buffer_spec: Sequence[ParameterSpec],
        parameter_count: int,
        buffer_counts: tuple[int, int] | None,
    ) -> None:
        """Refuse, before a byte of it is received, a streamed first upload whose header's sizes
        (`parameter_count` values, `buffer_counts` float32 and int64 buffer values, or None) cannot
        initialise θ."""
        self._replicas.require_primary()  # a backup's state is not for a worker to set
        state = self._state
        counts = (parameter_count, buffer_counts)
        check_upload(spec, buffer_spec, counts, state.partition, state.max_parameters)

    @property
    def num_parameters(self) -> int:
        """P held here: the length of θ (this partition's range), 0 before it is initialised."""
        return self._state.core.num_parameters

    def round_takes_next(self, worker_id: str) -> bool:
        """Whether the round open now takes `worker_id`'s next commit (CommitCore.round_takers)."""
        return worker_id in self._state.core.round_takers()

    def require_primary(self) -> None:
        """Unavailable (not_primary) unless this replica is its partition's primary (or the
        partition is not replicated): checked before anything a backup would answer otherwise."""
        self._replicas.require_primary()

    def require_initialized(self) -> None:
        """FailedPrecondition until a worker has set θ."""
        self._state.require_initialized()

    def expected_payload_bytes(self, dtype: int, shape: tuple[int, ...]) -> int:
        """Bytes a streamed commit's payload of this dtype and shape must have; refused unless this
        replica is primary (first: a backup not seeded yet must not say `not_initialized`, which
        sends workers to register again), θ is initialised and the shape is flat [P]."""
        self._replicas.require_primary()
        return self._state.expected_payload_bytes(dtype, shape)

    @property
    def version(self) -> int:
        return self._state.core.version

    @property
    def history(self) -> str:
        """This process's history token: a version counts in it only (see ServerState.history)."""
        return self._state.history

    # -- the RPCs' work ----------------------------------------------------------------------

    async def register(
        self,
        worker_name: str,
        spec: tuple[ParameterSpec, ...],
        initial: EncodedTensor | None,
        include_parameters: bool = True,
        buffer_spec: tuple[ParameterSpec, ...] = (),
        initial_buffers: EncodedBuffers | None = None,
        client_id: str = "",
        job: str = "",
    ) -> tuple[RegistrationOutcome, Registration]:
        """Admit a worker; `include_parameters` False when its reply leaves θ out (it pulls θ next);
        `job`: the one its client knows ("" none): refused where θ is another job's."""
        self._replicas.require_primary()
        if not self._registrations.allow():
            self._metrics.refusal(Reason.REGISTRATION_RATE)
            raise ResourceExhausted(
                f"more than {self.config.max_registrations_per_minute} registrations in a minute; retry later "
                "(raise --max-registrations-per-minute)",
                Reason.REGISTRATION_RATE,
            )
        state = self._state
        registered = await self._applier.submit(
            lambda: state.register(
                worker_name, spec, initial, include_parameters, buffer_spec, initial_buffers, client_id, job
            )
        )
        worker = registered.worker
        shard = state.registry.shard(worker, self.config.num_shards)  # wrapped; shared when workers outnumber shards
        await self._addresses.refreshed()  # the layout as announced now (the file: read off the loop)
        if (displaced := registered.displaced) is not None:
            self._evicted([displaced], reason=registered.displaced_because)
            self._wake_round_takers()
        if registered.initialized_theta:
            tune_for(4 * state.core.num_parameters)
            event(
                log,
                "central variable initialised",
                parameters=state.core.num_parameters,
                tensors=len(state.spec),
                worker_id=worker.worker_id,
            )
        worker_events.joined(self._metrics, worker, shard, len(state.registry), registered.snapshot.version)
        if registered.shared_name:
            worker_events.name_shared(worker)
        registration = Registration(
            worker_id=worker.worker_id,
            lease_ttl_seconds=self.config.lease_ttl,
            config=self.config.training,
            shard=shard,
            version=registered.snapshot.version,
            initialized_central=registered.initialized_theta,
            layout=self.layout(),
            data_plane=self.data_plane.for_worker(worker),
            job=state.job,
        )
        return registered, registration

    def data_plane_ticket(self, worker_id: str) -> bytes:
        """`worker_id`'s registration's data-plane ticket, which the data plane's handshake proves
        this server holds before the client proves it does (gemps_proto/proofs.py):
        Unavailable (not_primary) at a replica that is not primary, whatever it knows of the worker
        (a backup not seeded yet knows none: `unknown_worker` there sent every worker to register
        again under a new id, its GEM state lost, issue 41 item 6); NotFound for a worker not
        registered."""
        self._replicas.require_primary()
        worker = self._state.registry.get(worker_id)
        return self.data_plane.tickets.issue(worker.worker_id, worker.client_id)

    async def pull(self, worker_id: str, known_version: int, reply_dtype: int, wait: float = 0.0) -> Snapshot:
        """The current snapshot, encoded in `reply_dtype` unless the caller already has its version;
        with `wait` seconds, once θ moved past `known_version` if it has not yet (or they passed)."""
        snapshot, encode = self._current(worker_id, known_version, reply_dtype, wait)
        if wait and self.unchanged(known_version, snapshot.version):
            loop, moved = asyncio.get_running_loop(), asyncio.Event()

            def wake() -> None:  # from the thread that counted the commit
                loop.call_soon_threadsafe(moved.set)

            forget = self.when_moved(known_version, wait, wake, worker_id)
            if forget is not None:
                try:
                    await asyncio.wait_for(moved.wait(), wait)
                except TimeoutError:
                    pass  # answered unchanged
                finally:
                    forget()
            snapshot, encode = self._current(worker_id, known_version, reply_dtype)
        if encode:  # on the applier: theta may be moving
            snapshot = await self._applier.submit(functools.partial(self._state.core.encoded, reply_dtype))
        return snapshot

    def pull_then(
        self, worker_id: str, known_version: int, reply_dtype: int, deliver: Deliver[Snapshot], wait: float = 0.0
    ) -> None:
        """pull() for the data plane's loop (a thread that cannot await: the caller that needs
        this half): `deliver` gets the snapshot, at once unless the applier must encode it first
        (then from the applier's thread). The data plane holds a pull itself (`when_moved`) before
        it calls this; `wait` is checked here all the same."""
        snapshot, encode = self._current(worker_id, known_version, reply_dtype, wait)
        if not encode:
            deliver(snapshot, None)
            return

        def encoded(timed: Timed[Snapshot] | None, error: BaseException | None) -> None:
            deliver(None if timed is None else timed.result, error)

        self._applier.submit_then(functools.partial(self._state.core.encoded, reply_dtype), encoded)

    def when_moved(
        self, known_version: int, wait: float, wake: Callable[[], None], worker_id: str = ""
    ) -> Callable[[], bool] | None:
        """Hold a pull of θ at `known_version` for up to `wait` seconds (the caller's timer):
        ThetaWaits.hold, `wake` called from the thread that counted the commit that moved θ.
        None: no `wait`, or no hold (answer now); InvalidArgument for a `wait` out of range."""
        check_pull_wait(wait)
        unmoved = lambda: self.unchanged(known_version) and not self.round_takes_next(worker_id)  # noqa: E731
        return self.waits.hold(unmoved, wake, worker_id) if wait else None

    def unchanged(self, known_version: int, version: int | None = None) -> bool:
        """Whether a caller holding θ at `known_version` holds θ at `version` (the current one by
        default): a pull's reply then carries none (a rule of rounds keeps θ over several versions)."""
        core = self._state.core
        return core.same_theta(known_version, core.version if version is None else version)

    def _current(
        self, worker_id: str, known_version: int, reply_dtype: int, wait: float = 0.0
    ) -> tuple[Snapshot, bool]:
        """The current snapshot, and whether the applier must encode it in `reply_dtype` first."""
        self._replicas.require_primary()
        state = self._state
        state.require_initialized()
        if worker_id:
            state.registry.touch(worker_id)
        check_reply_dtype(reply_dtype)
        check_pull_wait(wait)
        snapshot = state.core.snapshot
        changed = not self.unchanged(known_version, snapshot.version)
        if changed:  # the reply carries θ
            self._metrics.tensor_bytes("sent", reply_dtype, expected_nbytes(reply_dtype, [state.core.num_parameters]))
        return snapshot, changed and snapshot.data(reply_dtype) is None

    async def commit(self, commit: Commit, reply: ReplyWriter[R]) -> tuple[CommitOutcome, R]:
        """Apply a commit in FIFO order, with its `reply` written by the state right after, while θ
        holds the commit's version (see ReplyWriter); metrics, logs and checkpoints once it is
        applied. The applier runs the commit core's own method: no frame of this file in between."""
        self._replicas.require_primary()
        apply = functools.partial(self._state.core.commit_and_reply, commit, reply)
        # Small models: applied on the event loop when the applier is idle (see Applier.submit_timed).
        inline = self._state.core.num_parameters <= INLINE_MAX_PARAMETERS
        timed = await self._applier.submit_timed(apply, inline=inline)
        committed = self._committed(commit, timed)
        await acknowledged(self._replicas, committed[0].position)
        return committed

    def commit_then(
        self,
        commit: Commit,
        reply: ReplyWriter[R],
        deliver: Deliver[tuple[CommitOutcome, R]],
        mirror: np.ndarray | None = None,
    ) -> None:
        """commit() for the data plane's loop (a thread that cannot await: the caller that needs
        this half; the gRPC servicer awaits commit()): `deliver` gets the outcome and the reply
        the writer built (from θ written to `mirror` as the rule computed it, when given: the
        client's shared memory, the domain's `out=`; the keyword stays the data plane's).
        Runs on the calling thread when the applier is idle (delivered at once), whatever the
        model's size: handing it to the applier's thread and back cost more server CPU per commit
        than the loop's I/O it would overlap (1M parameters, 8 clients: 2.5-2.8 ms against
        1.7-2.2, and 250-390 commits/s against 360-450, two runs each); else on the applier's
        thread, after what is queued there."""
        self._replicas.require_primary()
        apply = functools.partial(self._state.core.commit_and_reply, commit, reply, out=mirror)

        def applied(timed: Timed[tuple[CommitOutcome, R]] | None, error: BaseException | None) -> None:
            if timed is None:
                deliver(None, error)
                return
            committed = self._committed(commit, timed)
            # The reply is written; it is handed over once the commit may be acknowledged.
            self._replicas.when_replicated(
                committed[0].position,
                lambda refusal: deliver(committed, None) if refusal is None else deliver(None, refusal),
            )

        self._applier.submit_then(apply, applied, inline=True)

    def _committed(self, commit: Commit, timed: Timed[tuple[CommitOutcome, R]]) -> tuple[CommitOutcome, R]:
        """A commit's bookkeeping once the applier ran it, whichever wire it came through."""
        outcome, built = timed.result
        traffic, sent = self._metrics.traffic, outcome.reply_dtype(commit.reply_dtype)  # per commit: no facade
        traffic.tensor_bytes("received", commit.payload.dtype, len(commit.payload.data))
        if not outcome.unchanged:  # else its reply carries no θ
            traffic.tensor_bytes("sent", sent, expected_payload_nbytes(sent, (self._state.core.num_parameters,)))
        if outcome.duplicate:
            self._refusals.duplicate(commit.worker_id, commit.request_id, outcome.snapshot.version)
            return outcome, built
        if not outcome.stats.kept_theta:
            self.waits.moved()  # the pulls held for θ to move (a round's waiting workers)
        else:  # a round took it (or dropped it): it may want some waiting workers' next commits
            self._wake_round_takers()
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
        self._replicas.require_primary()
        state = self._state
        worker = await self._applier.submit(lambda: state.leave(worker_id))
        self._wake_round_takers()
        worker_events.left(self._metrics, worker, len(state.registry))

    async def status(self) -> ServerStatus:
        await self._addresses.refreshed()  # the layout as announced now (the file: read off the loop)
        return server_status(
            self.config,
            self._state,
            commits_rejected=self._refusals.commits_rejected,
            uptime_seconds=time.monotonic() - self._started,
            last_evaluation=self.last_evaluation,
            layout=self.layout(),
            replication=self._replicas.status(),
            data_plane=self.data_plane.announced(),
        )

    def layout(self) -> Layout | None:
        """How θ is partitioned, as this partition announces it (service_reads.partition_layout),
        with the addresses last read (Register and Status read them again first)."""
        return partition_layout(self.config, self._state.spec, self._addresses)

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self._replicas.require_primary()
        check_evaluation(evaluation, self._state.core.version)
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
        """Forget the workers whose lease ran out (the app calls this periodically); a backup
        leaves that to its primary (it applies the evictions its primary journals)."""
        try:
            self._replicas.require_primary()
        except ServiceError:
            return
        evicted = await self._applier.submit(self._state.evict_expired)
        self._wake_round_takers()
        for reason in dict.fromkeys(reason for _, reason in evicted):
            self._evicted([worker for worker, why in evicted if why == reason], reason)

    def _wake_round_takers(self) -> None:
        """After a commit that kept θ, or workers leaving: the held pulls of the workers whose next
        commits the open round takes are answered (PullResponse.round_takes_next)."""
        if takers := self._state.core.round_takers():
            self.waits.moved(takers)

    def _evicted(self, workers: list[WorkerRecord], reason: str) -> None:
        """Count and log workers the server forgot without their leaving."""
        worker_events.evicted(self._metrics, workers, reason, self.config.lease_ttl, len(self._state.registry))
