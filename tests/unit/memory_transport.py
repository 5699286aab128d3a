"""An in-memory server process behind the SDK's transport interface, for tests without a server.

It holds θ (its partition's range), counts versions, applies commits like DOWNPOUR (θ ← θ - η·g,
or θ + Δ for kind "update"), answers each (client id, request id) once, and can be told to
forget its workers or to fail its next calls with a retryable error. It records what it was sent.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from gemps import errors
from gemps.records import (
    Evaluation,
    Layout,
    ParameterSpec,
    Partition,
    Registration,
    ReplicationStatus,
    ServerStatus,
    Shard,
    TrainingConfig,
)
from gemps.transport import CommitCall, Committed, Enrolment, PullCall, Pulled, Registered, refuse_non_finite
from gemps_proto.reasons import Reason
from gemps_proto.schema import Buffers, PayloadKind, partition_bounds

T = TypeVar("T")


class Finished(Generic[T]):
    """A call already done when started: `result()` gives its reply or raises its error, and
    notes in `events` when it was read."""

    def __init__(self, call: Callable[[], T], events: list[str], target: str) -> None:
        self._events, self._target = events, target
        self._reply: T | None = None
        self._error: errors.GempsError | None = None
        try:
            self._reply = call()
        except errors.GempsError as error:
            self._error = error

    def result(self) -> T:
        self._events.append(f"finish {self._target}")
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply


@dataclass(eq=False)
class MemoryServer:
    """One server process (all of θ, or the partition `layout.index` of it), in memory."""

    target: str
    learning_rate: float = 0.5
    layout: Layout | None = None  # what it announces when θ is partitioned
    scaling: float = 1.0  # the scaling figures it reports for every commit
    theta: np.ndarray | None = None
    buffers: Buffers | None = None
    version: int = 0
    history: str = "first"
    fail_next: int = 0  # calls still to refuse with UNAVAILABLE
    lose_next_reply: bool = False  # apply the next commit, then answer UNAVAILABLE
    spec: tuple[ParameterSpec, ...] = ()
    buffer_spec: tuple[ParameterSpec, ...] = ()
    workers: dict[str, str] = field(default_factory=dict)  # worker id -> client id
    applied: dict[tuple[str, str], Committed] = field(default_factory=dict)
    enrolments: list[Enrolment] = field(default_factory=list)
    commits: list[CommitCall] = field(default_factory=list)  # every attempt that reached it
    pulls: list[PullCall] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    closed: bool = False
    replication: ReplicationStatus | None = None  # what its Status reports of replication
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def forget_workers(self) -> None:
        self.workers.clear()

    def restart_empty(self, version: int = 0) -> None:
        """Lose θ and every worker, as a server restarted without a checkpoint."""
        self.theta, self.buffers, self.version, self.history = None, None, version, "restarted"
        self.workers.clear()

    # -- the transport interface -----------------------------------------------------------------

    def register(self, enrolment: Enrolment, known_history: str) -> Registered:
        self._attempt("register")
        self.enrolments.append(enrolment)
        initialized = self.theta is None
        if self.theta is None:
            values = enrolment.values
            start, stop = self._range(values.size)
            self.theta = (values if values.size == stop - start else values[start:stop]).copy()
            self.spec, self.buffer_spec = enrolment.spec, enrolment.buffer_spec
            if enrolment.buffer_spec and enrolment.buffers is not None:
                self.buffers = enrolment.buffers
        worker_id = f"{self.target}/worker-{next(self._ids)}"
        self.workers = {w: c for w, c in self.workers.items() if c != enrolment.client_id}
        self.workers[worker_id] = enrolment.client_id
        registration = Registration(
            worker_id, 30.0, TrainingConfig(), Shard(0, 0), self.version, initialized, self.layout
        )
        parameters = None if initialized else self.theta.copy()
        return Registered(registration, parameters, self._buffers(), self.version)

    def pull(self, call: PullCall) -> Pulled:
        self._attempt("pull")
        self.pulls.append(call)
        if call.worker_id:
            self._worker(call.worker_id)
        if self.theta is None:
            raise errors.FailedPreconditionError("not initialised", None, Reason.NOT_INITIALIZED)
        if call.known_version == self.version and call.known_history == self.history:
            return Pulled(self.version, None, None, self.history)
        return Pulled(self.version, self.theta.copy(), self._buffers(), self.history)

    def start_pull(self, call: PullCall) -> Finished[Pulled]:
        self.events.append(f"start {self.target}")
        return Finished(lambda: self.pull(call), self.events, self.target)

    def commit(self, call: CommitCall) -> Committed:
        if call.check_finite:  # a transport checks what its router left it to (CommitCall.check_finite)
            refuse_non_finite("payload", call.payload)
        self._attempt("commit")
        self.commits.append(call)
        client_id = self._worker(call.worker_id)
        key = (client_id, call.request_id)
        if key in self.applied:  # exactly once: a retry answers as the original did
            return self.applied[key]
        assert self.theta is not None
        if call.payload.size != self.theta.size:
            raise errors.InvalidArgumentError("payload size", None, Reason.BAD_SHAPE)
        step = -self.learning_rate * call.payload if call.kind is PayloadKind.GRADIENT else call.payload
        self.theta = (self.theta + step).astype(np.float32)
        if call.buffer_delta is not None and self.buffers is not None:
            delta = call.buffer_delta
            self.buffers = Buffers(self.buffers.floats + delta.floats, self.buffers.integers + delta.integers)
        staleness = self.version - call.base_version
        self.version += 1
        scaling = self.scaling
        committed = Committed(
            self.version, staleness, scaling, scaling, scaling, scaling, self.theta.copy(), self._buffers()
        )
        self.applied[key] = committed
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise errors.ServerUnavailableError("UNAVAILABLE: reply lost")
        return committed

    def start_commit(self, call: CommitCall) -> Finished[Committed]:
        self.events.append(f"start {self.target}")
        return Finished(lambda: self.commit(call), self.events, self.target)

    def leave(self, worker_id: str) -> None:
        self._attempt("leave")
        self._worker(worker_id)
        del self.workers[worker_id]

    def status(self) -> ServerStatus:
        self._attempt("status")
        size = 0 if self.theta is None else self.theta.size
        return ServerStatus(
            self.theta is not None, self.version, len(self.workers), size, TrainingConfig(), 0, 0, self.spec, 0.0, None,
            buffer_spec=self.buffer_spec, layout=self.layout, replication=self.replication,
        )  # fmt: skip

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self._attempt("report_evaluation")
        self.evaluations.append(evaluation)

    def resume(self, registration: Registration) -> None:
        self.events.append(f"resume {self.target} {registration.worker_id}")

    def interrupt(self) -> None:
        self.events.append(f"interrupt {self.target}")

    def close(self) -> None:
        self.closed = True

    # -- internals -------------------------------------------------------------------------------

    def _attempt(self, call: str) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise errors.ServerUnavailableError(f"UNAVAILABLE: {self.target} refused {call}")

    def _worker(self, worker_id: str) -> str:
        if worker_id not in self.workers:
            raise errors.WorkerNotFoundError(f"NOT_FOUND: unknown worker {worker_id}", None, Reason.UNKNOWN_WORKER)
        return self.workers[worker_id]

    def _range(self, num_values: int) -> tuple[int, int]:
        if self.layout is None:
            return 0, num_values
        partition = self.layout.partitions[self.layout.index]
        return partition.start, partition.stop

    def _buffers(self) -> Buffers | None:
        return None if self.buffers is None or not self.buffer_spec else self.buffers  # never changed in place


def memory_cluster(
    num_parameters: int, partitions: int, host: str = "memory", learning_rate: float = 0.5
) -> list[MemoryServer]:
    """`partitions` server processes at host:7000, host:7001, ..., each announcing the layout
    (partition 0 names itself "", the others ":PORT")."""
    if partitions == 1:
        return [MemoryServer(f"{host}:7000", learning_rate)]
    bounds = partition_bounds(num_parameters, partitions)
    events: list[str] = []  # one list: the order of calls across servers
    announced = tuple(
        Partition("" if index == 0 else f":{7000 + index}", start, stop) for index, (start, stop) in enumerate(bounds)
    )
    return [
        MemoryServer(f"{host}:{7000 + index}", learning_rate, Layout(index, announced, num_parameters), events=events)
        for index in range(partitions)
    ]


def connector(servers: list[MemoryServer]) -> Callable[[str], MemoryServer]:
    """The `connect` a Client takes: the server at an address."""
    by_target = {server.target: server for server in servers}
    return by_target.__getitem__
