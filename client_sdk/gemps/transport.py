"""The seam between the client and one server process: what a transport does, in domain terms.

A transport carries one attempt of each call to one server process (all of θ, or one partition
of it) and raises typed GempsError subclasses when it fails. It speaks numpy arrays and the
SDK's records, never protobuf messages or channel objects, so transports other than gRPC
(`gemps.grpc_transport`) can plug in. Retries and registering again when a server forgot the
worker are the transport's caller's (`gemps.server_session`), written once for every transport.

A call of the Client has one deadline (`call_deadline`, its `timeout`), which every attempt,
retry wait and fallback within it shares: a transport bounds each attempt by `time_left`, never
by its own timeout alone (issue 42, item 5: a `timeout=5` call took 28.6 s, each of its attempts
bounded, not the call).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from gemps import errors
from gemps.records import Buffers, Evaluation, Layout, ParameterSpec, Registration, ServerStatus
from gemps_proto.gradient_sums import GradientSums
from gemps_proto.reasons import Reason
from gemps_proto.schema import PayloadKind
from gemps_proto.tensor_codec import all_finite, wire_view
from gemps_proto.vectors import Vector

if TYPE_CHECKING:
    from gemps_proto.block_quantisation import BlockCodes

Reply = TypeVar("Reply", covariant=True)


@dataclass(frozen=True)
class Enrolment:
    """What a worker registers with at one server: the first server gets all of θ and the
    buffers, a later partition its slice of θ only."""

    spec: tuple[ParameterSpec, ...]
    worker_name: str
    client_id: str
    values: Vector  # flat float32 initial values: all of θ, or this partition's slice
    buffer_spec: tuple[ParameterSpec, ...] = ()
    buffers: Buffers | None = None
    layout: Layout | None = None  # the layout the client holds: registering again may not change it
    job: str = ""  # the job the client registered with first ("": none yet): another job's server refuses


@dataclass(frozen=True)
class Registered:
    """A server's answer to Register: the registration, its θ (None: the values sent set it),
    its buffers (None: the model has none) and the version and history that θ counts in."""

    registration: Registration
    parameters: Vector | None
    buffers: Buffers | None
    version: int
    history: str = ""


@dataclass(frozen=True)
class PullCall:
    worker_id: str  # "" for a read-only pull
    known_version: int  # of the slice held; -1: none
    known_history: str
    size: int  # how many values the server holds
    wait_seconds: float = 0.0  # how long the server may hold a reply that would be unchanged (until θ moves)


@dataclass(frozen=True)
class Pulled:
    version: int
    parameters: Vector | None  # None: unchanged since `known_version`
    buffers: Buffers | None
    history: str
    round_takes_next: bool = False  # unchanged, and the open round takes our next commit on it (gemps.rounds)


@dataclass(frozen=True)
class CommitCall:
    """One server's part of a commit: every attempt carries the same `request_id` and `sequence`
    (the commit's place among its client's: the server refuses an attempt that arrives after a
    later commit of the client was applied, so a late attempt is never applied again)."""

    worker_id: str
    base_version: int
    kind: PayloadKind
    payload: Vector  # flat float32, in the server's range
    loss: float | None
    num_samples: int | None
    request_id: str
    buffer_delta: Buffers | None = None  # to the first server only
    sequence: int = 0  # 1, 2, ... per client; 0: unnumbered
    encoded: tuple[int, bytes] | None = None  # the payload compressed once for every attempt (dtype, bytes)
    # Difference replies (gemps_proto.reply_differences): the code asked for (0: θ in the wire
    # dtype) and the number of the copy of θ this client holds of the server's slice (0: none).
    reply_code: int = 0
    held_copy: int = 0
    # The payload is not checked yet: the transport refuses NaN or Inf before it sends anything
    # (where it copies the payload anyway, on that copy). A router of one server leaves it there.
    check_finite: bool = False
    # This server's history, sent when the client holds its θ of `base_version`: a reply whose θ is
    # still that one carries none (Committed.parameters None). Empty: θ always comes back.
    known_history: str = ""
    gradient_sums: GradientSums | None = None  # an update's window of local steps, measured (gemps_proto.gradient_sums)

    def wire(self, wire_dtype: int) -> tuple[int, bytes | memoryview]:
        """The payload's dtype and wire bytes: as compressed (`encoded`), else in `wire_dtype`
        (float32: a view of `payload`, not a copy)."""
        if self.encoded is not None:
            return self.encoded
        return wire_dtype, wire_view(self.payload, wire_dtype)


@dataclass(frozen=True)
class Committed:
    """One server's reply to a commit: its figures, its θ after the commit (None: the θ of the
    call's base version, which the call said it holds: CommitCall.known_history, or a difference
    reply's, whose θ is the held copy moved by `difference`) and its buffers."""

    version: int
    staleness: int
    scaling_mean: float
    scaling_median: float
    scaling_at_zero: float
    scaling_at_max: float
    parameters: Vector | None
    buffers: Buffers | None
    epoch: int = 0  # the epoch of the primary that acknowledged it (0: not replicated)
    # Difference replies: the copy the client holds once it applied this reply, and the copy
    # `difference` is a difference from (0: `parameters` is θ whole); both 0 for other replies.
    copy: int = 0
    difference_of: int = 0
    round_pending: int = 0  # commits before θ moves, for a rule of rounds (else 0)
    # A difference reply's code, checked and not decoded: the copy reads it a run of blocks at a time.
    difference: BlockCodes | None = None


class Pending(Protocol[Reply]):
    """A call started and not yet finished: `result()` waits for the reply or raises GempsError."""

    def result(self) -> Reply: ...


class Deferred(Generic[Reply]):
    """A request sent: `result()` reads its reply (`read`, on the caller's thread)."""

    def __init__(self, read: Callable[[], Reply]) -> None:
        self._read = read

    def result(self) -> Reply:
        return self._read()


class Failed(Generic[Reply]):
    """A call that failed before its request was sent: `result()` raises, as a gRPC future's does,
    so a router that started calls on several servers retries this one like any other."""

    def __init__(self, error: errors.GempsError) -> None:
        self._error = error

    def result(self) -> Reply:
        raise self._error


class Transport(Protocol):
    """One server process, one attempt per call. Every failure is a GempsError."""

    @property
    def target(self) -> str: ...

    def register(self, enrolment: Enrolment, known_history: str) -> Registered: ...

    def pull(self, call: PullCall) -> Pulled: ...

    def start_pull(self, call: PullCall) -> Pending[Pulled]: ...

    def commit(self, call: CommitCall) -> Committed: ...

    def start_commit(self, call: CommitCall) -> Pending[Committed]: ...

    def leave(self, worker_id: str) -> None: ...

    def status(self) -> ServerStatus: ...

    def report_evaluation(self, evaluation: Evaluation) -> None: ...

    def resume(self, registration: Registration) -> None:
        """Serve `registration`, made with another replica of this server's partition (replicas
        share registrations): a transport that made more of a registration than its worker id (the
        data plane's ticket) makes the same of this one. No I/O."""
        ...

    def interrupt(self) -> None:
        """Wake a call of another thread blocked on this server (it fails; gemps.primary_watch:
        another replica took over from a primary that stopped, or it won its lease again); the
        next call goes on a new connection (the session stays here when no move is proven)."""
        ...

    def close(self) -> None: ...


def refuse_non_finite(what: str, values: Vector) -> Vector:
    """`values` when every one is finite; else InvalidArgumentError before anything is sent, so that
    no partition of θ applies a commit that another would refuse."""
    if not all_finite(values):
        raise errors.InvalidArgumentError(
            f"{what} contains NaN or Inf: not sent", errors.InvalidArgumentError.code, Reason.NON_FINITE
        )
    return values


# -- the call's deadline ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic() when the call's time is spent
    seconds: float  # the timeout it was set from (for messages)

    def left(self) -> float:
        return self.at - time.monotonic()


_deadline: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("gemps_call_deadline", default=None)


class call_deadline:
    """The current call's deadline, `seconds` from now (or at the monotonic time `at`), for what
    runs inside (this thread): an outer call's, when that is sooner, stays. A class, not a
    generator: every call of the client enters one (a generator's context manager costs several
    times more)."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, seconds: float, at: float | None = None) -> None:
        self._deadline = Deadline(time.monotonic() + seconds if at is None else at, seconds)
        self._token: contextvars.Token[Deadline | None] | None = None

    def __enter__(self) -> Deadline:
        outer = _deadline.get()
        if outer is not None and outer.at <= self._deadline.at:
            return outer
        self._token = _deadline.set(self._deadline)
        return self._deadline

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _deadline.reset(self._token)


def current_deadline() -> Deadline | None:
    """The deadline of the call running on this thread (None: no Client call set one)."""
    return _deadline.get()


def time_left(timeout: float) -> float:
    """Seconds an attempt may take: `timeout` (a transport's own), or less when the call's
    deadline is sooner; DeadlineExceededError, before anything is sent, once it has passed."""
    deadline = _deadline.get()
    if deadline is None:
        return timeout
    left = deadline.left()
    if left <= 0:
        raise deadline_exceeded(deadline)
    return min(timeout, left)


def deadline_exceeded(deadline: Deadline, detail: str = "") -> errors.DeadlineExceededError:
    return errors.DeadlineExceededError(
        f"DEADLINE_EXCEEDED: the call's timeout of {deadline.seconds:g}s is spent" + (f": {detail}" if detail else ""),
        errors.DeadlineExceededError.code,
    )
