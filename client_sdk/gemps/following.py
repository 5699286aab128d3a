"""A transport that follows its server process when it moves (DESIGN §3a).

A server process can be restarted on another machine, on fresh ports. After a call to it failed in
a way worth another attempt, the next call first asks `follow` (the router's: where is this server
now?) and, when it moved, goes on through a transport to its new address. Retries of a commit then
reach the new process with the same request id and number, so nothing is applied twice. It is a
Transport itself, so the session's retries and the router's concurrent calls need not know.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

from gemps import errors
from gemps.primary_watch import PROBE_SECONDS, PrimaryWatch, Watched
from gemps.records import Evaluation, Registration, ServerStatus
from gemps.transport import (
    CommitCall,
    Committed,
    Deferred,
    Enrolment,
    Pending,
    PullCall,
    Pulled,
    Registered,
    Transport,
    call_deadline,
)
from gemps_proto.jobs import describe_job
from gemps_proto.reasons import Reason

log = logging.getLogger("gemps.client")
T = TypeVar("T")
# Where a server process is now: a transport to its new address when it moved, else None.
Follow = Callable[[], Transport | None]


class FollowingTransport:
    """`transport`, replaced by the one `follow` gives after a failure when its server moved; the
    new one is handed `registered()`, the session's registration (another replica of a partition
    knows it: its data plane takes the same ticket). `announced`: the address is one a server of
    this client announced (partition 0's layout), not the user's: another gRPC service there is the
    partition gone from its first call, not a wrong address to refuse."""

    def __init__(
        self,
        transport: Transport,
        follow: Follow | None = None,
        registered: Callable[[], Registration | None] | None = None,
        watch: PrimaryWatch | None = None,
        *,
        announced: bool = False,
    ) -> None:
        self.transport = transport
        self.follow = follow
        self.registered = registered
        self.announced = announced
        self.watch = watch  # a replicated partition: calls waiting on a stopped primary move on
        self.moves = 0  # how often it followed its server to another address
        self._suspect = False  # a call failed in a way worth another attempt: the server may have moved
        # Whether a call succeeded since the last move: only the first move after one is worth a
        # warning (going round a replica set during a failover moves several times a second).
        self._answered = True
        self._other_jobs: set[str] = set()  # addresses found holding another job's θ (warned once each)

    @property
    def target(self) -> str:
        return self.transport.target

    def suspect(self, error: errors.GempsError) -> None:
        """A call's failure seen elsewhere (a started call's result): look before the next one."""
        if isinstance(error, errors.RETRIED):
            self._suspect = True

    def register(self, enrolment: Enrolment, known_history: str) -> Registered:
        return self._call(lambda transport: transport.register(enrolment, known_history))

    def pull(self, call: PullCall) -> Pulled:
        return self._call(lambda transport: transport.pull(call))

    def start_pull(self, call: PullCall) -> Pending[Pulled]:
        pending, started_on = self._call(lambda transport: transport.start_pull(call)), self.transport
        return Deferred(lambda: self._call(lambda _: pending.result(), started_on))  # its wait watched too

    def commit(self, call: CommitCall) -> Committed:
        return self._acknowledged(self._call(lambda transport: transport.commit(call)))

    def start_commit(self, call: CommitCall) -> Pending[Committed]:
        pending, started_on = self._call(lambda transport: transport.start_commit(call)), self.transport
        # its wait watched too
        return Deferred(lambda: self._acknowledged(self._call(lambda _: pending.result(), started_on)))

    def leave(self, worker_id: str) -> None:
        self._call(lambda transport: transport.leave(worker_id))

    def status(self) -> ServerStatus:
        return self._call(lambda transport: transport.status())

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self._call(lambda transport: transport.report_evaluation(evaluation))

    def resume(self, registration: Registration) -> None:
        self.transport.resume(registration)

    def interrupt(self) -> None:
        self.transport.interrupt()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.transport.close()

    def _call(self, call: Callable[[Transport], T], transport: Transport | None = None) -> T:
        if transport is None:
            if self._suspect:
                self._follow()
            transport = self.transport
        # Once registered here (or at an address a server of ours announced), another gRPC service
        # at the address (UNIMPLEMENTED; another job's gemps server, which refused our job: other_job;
        # at an announced address a spec mismatch too) is whoever took the port since the server
        # died: gone, retried, on every call (registering again too), and the partition looked up
        # again: the next replica of a set. Never registered with (DESIGN §3d, "One job, one θ").
        with self.watch.watching(transport) if self.watch is not None else _unwatched(transport) as watched:
            try:
                result = call(transport)
            except errors.GempsError as error:
                other_job = error.reason == Reason.OTHER_JOB
                known = other_job or self.announced or (self.registered is not None and self.registered() is not None)
                failure = errors.foreign_as_gone(transport.target, error, announced=self.announced) if known else error
                if other_job:  # said once per address: a set is gone round many times while it fails over
                    level = logging.DEBUG if transport.target in self._other_jobs else logging.WARNING
                    self._other_jobs.add(transport.target)
                    log.log(level, "%s holds another job's θ: skipped (%s)", transport.target, error.message)
                if watched.took_over:  # interrupted: its partition's primary is elsewhere now
                    failure = _taken_over(transport.target, watched.took_over, error)
                if isinstance(failure, errors.RETRIED):
                    self._suspect = True
                if failure is error:
                    raise
                raise failure from None
        self._answered = True
        return result

    def _acknowledged(self, committed: Committed) -> Committed:
        """The watch learns the epoch that acknowledged: a primary seen under a newer one while a
        call waits lost its lease and won it again meanwhile (gemps.primary_watch)."""
        if self.watch is not None and committed.epoch:
            self.watch.epoch = committed.epoch
        return committed

    def _follow(self) -> None:
        self._suspect = False
        moved = self.follow() if self.follow is not None else None
        if moved is None:
            return
        registration = self.registered() if self.registered is not None else None
        if registration is not None and registration.job:
            self._prove_same_job(moved, registration.job)
        level = logging.WARNING if self._answered else logging.DEBUG
        log.log(level, "%s moved to %s: following it", self.transport.target, moved.target)
        self.transport.close()
        self.transport, self.moves, self._answered = moved, self.moves + 1, False
        if registration is not None:
            moved.resume(registration)

    def _prove_same_job(self, moved: Transport, job: str) -> None:
        """Before a byte of a commit goes to where the server moved: its Status names `job`, or
        no job yet (a partition restarted without its checkpoint: registering again sets it).
        Otherwise (another job's server, one that does not say) the move is not made: unavailable,
        retried at the next address (DESIGN §3d, "One job, one θ")."""
        try:
            with call_deadline(PROBE_SECONDS):
                held = moved.status().job
        except errors.GempsError as error:
            unproven = f"did not say which job it holds ({error.message})"
        else:
            if held in ("", job):
                return
            unproven = f"holds job {describe_job(held)}'s central variable, not this worker's job {describe_job(job)}"
            if moved.target not in self._other_jobs:  # said once per address: a set is gone round often
                self._other_jobs.add(moved.target)
                log.warning("%s %s: not followed", moved.target, unproven)
        moved.close()
        self._suspect = True  # the next call looks again: the next replica of a set
        raise errors.ServerUnavailableError(f"UNAVAILABLE: {moved.target} {unproven}: not followed")


class _unwatched(contextlib.nullcontext[Watched]):
    """A call of a session without a watch (a partition not replicated)."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(Watched(transport, 0.0))


def _taken_over(target: str, primary: str, error: errors.GempsError) -> errors.ServerUnavailableError:
    """The failure of a call a watch interrupted: unavailable (retried, at `primary`)."""
    news = (
        f"{primary} took over as its partition's primary"
        if primary != target
        else "is its partition's primary again under a newer epoch: the call is made again"
    )
    return errors.ServerUnavailableError(
        f"{target} stopped answering and {news} ({error.message})",
        errors.ServerUnavailableError.code,
        Reason.NOT_PRIMARY,
    )
