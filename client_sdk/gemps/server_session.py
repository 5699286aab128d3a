"""This client's session with one server process: what it holds of that server, and reliable calls.

θ may be split across several server processes ("partitions", docs/ARCHITECTURE.md): each holds
the contiguous range [start, stop) of the flat central variable with its own version, worker id
and lease. The client has one session per server process; a session keeps the registration it
got there and the newest slice of θ it received, retries a transport's calls (`Retrier`) and
registers again, once, when the server forgot the worker (lease expiry, server restart). Its
calls go through a FollowingTransport (gemps.following), which moves to where the server process
is now when it was restarted on another machine (`follow`, the router's).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from gemps import errors
from gemps.following import Follow, FollowingTransport
from gemps.held_copy import HeldCopy
from gemps.primary_watch import PrimaryWatch
from gemps.records import Evaluation, Layout, Registration, ServerStatus
from gemps.retry import Retrier
from gemps.transport import CommitCall, Committed, Enrolment, Pending, PullCall, Pulled, Registered, Transport
from gemps_proto import vectors
from gemps_proto.vectors import Vector

log = logging.getLogger("gemps.client")


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

    def __init__(
        self,
        transport: Transport,
        retrier: Retrier,
        follow: Follow | None = None,
        watch: PrimaryWatch | None = None,
        *,
        announced: bool = False,
    ) -> None:
        # Every call goes through the link; `announced` as FollowingTransport's.
        self.link = FollowingTransport(transport, follow, lambda: self.registration, watch, announced=announced)
        self.retrier = retrier
        self.start = 0  # the range of θ this server holds: [start, stop)
        self.stop = 0
        self.registration: Registration | None = None  # this server's registration of the client's worker
        self.version = -1  # of the slice held in `flat`; -1: none yet
        self.history = ""  # which history of this server `version` counts in ("unchanged" needs both)
        self.flat = vectors.empty_float32()
        self.copy = HeldCopy()  # difference replies: the copy of this slice of θ both ends keep

    @property
    def transport(self) -> Transport:
        """The transport to where the server process is now."""
        return self.link.transport

    @property
    def target(self) -> str:
        return self.link.target

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id if self.registration else ""

    def register(self, enrolment: Enrolment) -> Registered:
        """Register with this server (retrying); `hold` its θ once the range is known."""
        registered = self.retrier.call(self.link.register, enrolment, self.history)
        self.registration = registered.registration
        return registered

    def hold(self, registered: Registered, values: Vector) -> None:
        """Keep the θ a registration gave: the server's, or the `values` sent when they set it."""
        if registered.parameters is not None:
            self.version, self.flat = registered.version, vectors.flat(registered.parameters)
        else:
            mine = values if vectors.size(values) == self.size else values[self.start : self.stop]
            self.version, self.flat = registered.version, vectors.flat(mine)
        if registered.history:
            self.history = registered.history

    def received(self, version: int, flat: Vector, history: str = "") -> None:
        self.version, self.flat = version, vectors.flat(flat)
        if history:
            self.history = history

    def known_history(self, base_version: int, reply_code: int = 0) -> str:
        """What a commit made at `base_version` names as its history (CommitCall.known_history):
        this server's when the client holds its θ of that version (not for difference replies,
        whose copy moves apart), so a reply of the same θ may carry none; else none."""
        return self.history if base_version == self.version and not reply_code else ""

    def took(self, committed: Committed, call: CommitCall) -> None:
        """Hold the θ a commit's reply gave: θ itself, or the copy a difference reply moved (a
        reply to a copy has a number; θ whole numbered 0 is one the server could not keep), or the
        θ held when the reply says it is unchanged from the one `call` said it holds (named only
        for the θ held: a call sent again after registering again names its new base's)."""
        values = committed.parameters
        if values is None and committed.difference is None:
            if not call.known_history:
                raise errors.GempsError(
                    f"{self.target} answered commit {call.request_id!r} with no θ, as unchanged from "
                    f"version {call.base_version}, which this client did not say it holds"
                )
            self.version = committed.version  # the same θ, numbered on
            return
        if committed.copy or committed.difference_of:
            values = self.copy.took(committed)
        else:
            self.copy.forget()
        assert values is not None  # a difference comes with the copy's number (committed_from_proto)
        self.received(committed.version, values)

    def pull_call(self, wait: float = 0.0) -> PullCall:
        return PullCall(self.worker_id, self.version, self.history, self.size, wait)

    def start_pull(self, wait: float = 0.0) -> Pending[Pulled]:
        return self.link.start_pull(self.pull_call(wait))

    def pull(self, enrolment: Enrolment | None, wait: float = 0.0) -> Pulled:
        """Pull this server's slice (retrying); registered: with `enrolment` again if it forgot us.
        `wait`: how long the server may hold a reply that would be unchanged (PullRequest.wait_seconds)."""
        if self.registration is None:
            return self.retrier.call(self.link.pull, self.pull_call(wait))
        try:
            return self.retrier.call(self.link.pull, self.pull_call(wait))
        except errors.GempsError as error:
            registered = self._register_again(error, enrolment)
        pulled = self.retrier.call(self.link.pull, self.pull_call())  # the new worker id
        if pulled.parameters is None:  # unchanged since registering again: θ as registered
            pulled = replace(pulled, version=self.version, parameters=self.flat)
        return pulled if pulled.buffers is not None else replace(pulled, buffers=registered.buffers)

    def start_commit(self, call: CommitCall) -> Pending[Committed]:
        return self.link.start_commit(call)

    def commit(self, call: CommitCall, enrolment: Enrolment | None) -> Committed:
        """Commit to this server (retrying); with `enrolment` again if it forgot us, then with the
        base version `_rebased` on the registration's; or, refused as ahead of the server's
        version, once more after pulling θ (`_resynchronised`)."""
        counted_in = self.history  # the history the call's base version counts in
        try:
            return self.retrier.call(self.link.commit, call)
        except errors.GempsError as error:
            if errors.version_ahead(error):
                return self._resynchronised(call, error)
            registered = self._register_again(error, enrolment)
        base = self._rebased(call.base_version, counted_in, registered.registration.version)
        call = replace(call, worker_id=self.worker_id, base_version=base, known_history=self._named(call, base))
        committed = self.retrier.call(self.link.commit, call)
        return committed if committed.buffers is not None else replace(committed, buffers=registered.buffers)

    def _resynchronised(self, call: CommitCall, error: errors.GempsError) -> Committed:
        """The commit refused for a base version ahead of the server's, done again from the θ a
        pull gets now: the server went back in history under this worker (a failover to a replica
        without commits never acknowledged that a pull had shown). Repeating the refused commit
        left every worker refused for as long as they tried (issue 41)."""
        counted_in = self.history
        pulled = self.retrier.call(self.link.pull, replace(self.pull_call(), known_version=-1))
        if pulled.parameters is None:  # cannot be (no version named): the refusal as it came
            raise error
        log.warning(
            "%s is at version %d, behind the version %d worker %s held (a failover lost commits it "
            "never acknowledged): pulled its θ, committing again from there",
            self.target, pulled.version, call.base_version, self.worker_id,
        )  # fmt: skip
        self.received(pulled.version, pulled.parameters, pulled.history)
        base = self._rebased(call.base_version, counted_in, pulled.version)
        call = replace(call, base_version=base, known_history=self._named(call, base))
        return self.retrier.call(self.link.commit, call)

    def _named(self, call: CommitCall, base: int) -> str:
        """The history a commit sent again from `base` names: as it named one, if it still may."""
        return self.known_history(base) if call.known_history else ""

    def _rebased(self, base: int, counted_in: str, version: int) -> int:
        """The base version of a commit made at `base` of history `counted_in`, sent again now that
        this client holds the server's θ of `version` (registered again, or pulled). In the same
        history (a lease that expired, a failover to a replica) `base` names a θ of it: the
        commits since still count, up to `version` (a failover may have lost some). In another (a
        server restarted, from an older checkpoint or not) `base` names no θ of the new one: the
        commit is taken as made at `version`. Kept, `base` counted the new history's commits past
        that number as staleness this worker met (issue 77: 96 after a restart from an older
        checkpoint, and LocalSteps' job betas took β1 from 0.81 to 0.066). A server that names
        no history is taken as the same one."""
        if counted_in and self.history and counted_in != self.history:
            return version
        return min(base, version)

    def status(self) -> ServerStatus:
        return self.retrier.call(self.link.status)

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self.retrier.call(self.link.report_evaluation, evaluation)

    def leave(self) -> None:
        """Leave this server, if registered there (already evicted: nothing to free)."""
        if self.registration is None:
            return
        with contextlib.suppress(errors.WorkerNotFoundError):
            self.retrier.call(self.link.leave, self.worker_id)
        self.registration = None

    def _register_again(self, error: errors.GempsError, enrolment: Enrolment | None) -> Registered:
        """Register with our newest copy of θ when the server forgot us; `error` otherwise."""
        if enrolment is None or not errors.server_forgot_worker(error):
            raise error
        log.warning("%s forgot worker %s (%s); registering again", self.target, self.worker_id, error.message)
        registered = self.register(enrolment)
        refuse_partition_count_change(self.target, enrolment.layout, registered.registration.layout)
        self.hold(registered, enrolment.values)
        return registered
