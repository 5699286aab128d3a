"""This client's session with one server process: what it holds of that server, and reliable calls.

θ may be split across several server processes ("partitions", docs/ARCHITECTURE.md): each holds
the contiguous range [start, stop) of the flat central variable with its own version, worker id
and lease. The client has one session per server process; a session keeps the registration it
got there and the newest slice of θ it received, retries a transport's calls (`Retrier`) and
registers again, once, when the server forgot the worker (lease expiry, server restart).

A server process can also move (restarted on another machine, on fresh ports). After a call to it
failed in a way worth another attempt, the session asks `follow` (the router's: where is this
partition now?) before the next attempt, and moves its transport to the new address when there is
one; the attempt then goes there, with the same request id and number, so nothing is applied twice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from operator import methodcaller
from typing import TypeVar

import numpy as np

from gemps import errors
from gemps.records import Evaluation, Layout, Registration, ServerStatus
from gemps.retry import Retrier
from gemps.transport import CommitCall, Committed, Enrolment, Pending, PullCall, Pulled, Registered, Transport

log = logging.getLogger("gemps.client")
T = TypeVar("T")
# Where a server process is now: a transport to its new address when it moved, else None.
Follow = Callable[[], "Transport | None"]


def refuse_partition_count_change(target: str, held: Layout | None, announced: Layout | None) -> None:
    """A partitioned server cannot change its partition count while clients use it."""
    if held is not None and announced is not None and len(announced.partitions) != len(held.partitions):
        raise errors.FailedPreconditionError(
            f"{target} now has {len(announced.partitions)} partitions, not {len(held.partitions)}: "
            "a partitioned server cannot change its partition count while clients use it",
            errors.FailedPreconditionError.code,
        )


class ServerSession:
    """One server process (all of θ, or one partition of it) and what the client holds of it."""

    def __init__(self, transport: Transport, retrier: Retrier, follow: Follow | None = None) -> None:
        self.transport = transport
        self.retrier = retrier
        self.follow = follow
        self.moves = 0  # how often this session followed its server to another address
        self._suspect = False  # a call failed in a way worth another attempt: it may have moved
        self.start = 0  # the range of θ this server holds: [start, stop)
        self.stop = 0
        self.registration: Registration | None = None  # this server's registration of the client's worker
        self.version = -1  # of the slice held in `flat`; -1: none yet
        self.history = ""  # which history of this server `version` counts in ("unchanged" needs both)
        self.flat = np.empty(0, dtype=np.float32)

    @property
    def target(self) -> str:
        return self.transport.target

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id if self.registration else ""

    def register(self, enrolment: Enrolment) -> Registered:
        """Register with this server (retrying); `hold` its θ once the range is known."""
        registered = self._reliably(lambda transport: transport.register(enrolment, self.history))
        self.registration = registered.registration
        return registered

    def hold(self, registered: Registered, values: np.ndarray) -> None:
        """Keep the θ a registration gave: the server's, or the `values` sent when they set it."""
        if registered.parameters is not None:
            self.version, self.flat = registered.version, registered.parameters.reshape(-1)
        else:
            mine = values if values.size == self.size else values[self.start : self.stop]
            self.version, self.flat = registered.version, mine.reshape(-1)
        if registered.history:
            self.history = registered.history

    def received(self, version: int, flat: np.ndarray, history: str = "") -> None:
        self.version, self.flat = version, flat.reshape(-1)
        if history:
            self.history = history

    def pull_call(self) -> PullCall:
        return PullCall(self.worker_id, self.version, self.history, self.size)

    def start_pull(self) -> Pending[Pulled]:
        if self._suspect:
            self._follow()
        return self.transport.start_pull(self.pull_call())

    def pull(self, enrolment: Enrolment | None) -> Pulled:
        """Pull this server's slice (retrying); registered: with `enrolment` again if it forgot us."""
        if self.registration is None:
            return self._reliably(lambda transport: transport.pull(self.pull_call()))
        try:
            return self._reliably(lambda transport: transport.pull(self.pull_call()))
        except errors.GempsError as error:
            registered = self._register_again(error, enrolment)
        pulled = self._reliably(lambda transport: transport.pull(self.pull_call()))  # the new worker id
        if pulled.parameters is None:  # unchanged since registering again: θ as registered
            pulled = replace(pulled, version=self.version, parameters=self.flat)
        return pulled if pulled.buffers is not None else replace(pulled, buffers=registered.buffers)

    def start_commit(self, call: CommitCall) -> Pending[Committed]:
        if self._suspect:
            self._follow()
        return self.transport.start_commit(call)

    def commit(self, call: CommitCall, enrolment: Enrolment | None) -> Committed:
        """Commit to this server (retrying); with `enrolment` again if it forgot us, then with the
        base version clamped to the registration's (the server may have restarted older)."""
        try:
            # methodcaller: no frame of this file between the retrier and the transport (the
            # commit path crosses each file once, docs/ARCHITECTURE.md)
            committed: Committed = self._reliably(methodcaller("commit", call))
            return committed
        except errors.GempsError as error:
            registered = self._register_again(error, enrolment)
        version = registered.registration.version
        again = replace(call, worker_id=self.worker_id, base_version=min(call.base_version, version))
        committed = self._reliably(lambda transport: transport.commit(again))
        return committed if committed.buffers is not None else replace(committed, buffers=registered.buffers)

    def status(self) -> ServerStatus:
        return self._reliably(lambda transport: transport.status())

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self._reliably(lambda transport: transport.report_evaluation(evaluation))

    def leave(self) -> None:
        """Leave this server, if registered there (already evicted: nothing to free)."""
        if self.registration is None:
            return
        with contextlib.suppress(errors.WorkerNotFoundError):
            self._reliably(lambda transport: transport.leave(self.worker_id))
        self.registration = None

    def suspect(self, error: errors.GempsError) -> None:
        """A call here failed outside `_reliably` (a concurrent first attempt): before the next
        one, look whether the server moved."""
        if isinstance(error, errors.RETRIED):
            self._suspect = True

    def _reliably(self, call: Callable[[Transport], T]) -> T:
        """`call` on this server's transport, retried; following the server when it moved."""
        return self.retrier.call_on(self._current_transport, call, self._suspected)

    def _current_transport(self) -> Transport:
        if self._suspect:
            self._follow()
        return self.transport

    def _suspected(self) -> None:
        self._suspect = True  # a failure worth another attempt: the server may have moved

    def _follow(self) -> None:
        self._suspect = False
        moved = self.follow() if self.follow is not None else None
        if moved is None:
            return
        log.warning("%s moved to %s: following it", self.transport.target, moved.target)
        self.transport.close()
        self.transport, self.moves = moved, self.moves + 1

    def _register_again(self, error: errors.GempsError, enrolment: Enrolment | None) -> Registered:
        """Register with our newest copy of θ when the server forgot us; `error` otherwise."""
        if enrolment is None or not errors.server_forgot_worker(error):
            raise error
        log.warning("%s forgot worker %s (%s); registering again", self.target, self.worker_id, error.message)
        registered = self.register(enrolment)
        refuse_partition_count_change(self.target, enrolment.layout, registered.registration.layout)
        self.hold(registered, enrolment.values)
        return registered
