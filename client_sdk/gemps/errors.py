"""Typed exceptions for the SDK: callers catch these, never raw grpc errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from gemps_proto import reasons, versions
from gemps_proto.reasons import Reason

if TYPE_CHECKING:
    from gemps.records import CentralVariable


class GempsError(Exception):
    """Base class of every error the SDK raises. `code` is the gRPC status, when there is one."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None, reason: Reason | str = "") -> None:
        super().__init__(message)
        self.message = message
        #: why the server refused (a gemps.Reason, equal to its label such as "bad_shape"); a
        #: label this SDK does not know stays a plain string; "" when the server gave none
        self.reason: Reason | str = reasons.parse(reason) or reason
        if code is not None:
            self.code = code


class InvalidArgumentError(GempsError):
    """The server rejected the request's content (shape, dtype, NaN/Inf, version...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NamedPayloadError(InvalidArgumentError):
    """Named arrays (a commit's payload, a buffer delta) that do not match the registered spec by
    name and shape, refused by the SDK before anything is sent. `missing` and `unknown` name the
    entries absent from the arrays or from the spec; `shapes` maps each mismatched name to
    (expected shape, given shape). Reason SPEC_MISMATCH when names differ, else BAD_SHAPE."""

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        reason: Reason | str = "",
        *,
        missing: Sequence[str] = (),
        unknown: Sequence[str] = (),
        shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        # GempsError's signature first: PartiallyAppliedError.of may subclass any refusal's class.
        reason = reason or (Reason.SPEC_MISMATCH if missing or unknown else Reason.BAD_SHAPE)
        super().__init__(message, code or self.code, reason)
        self.missing = tuple(missing)
        self.unknown = tuple(unknown)
        self.shapes = dict(shapes or {})


class WorkerNotFoundError(GempsError):
    """The server does not know this worker (never registered, left, or evicted)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(GempsError):
    """The server is not in a state to serve this (spec mismatch, not initialised)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class IncompatibleVersionError(FailedPreconditionError):
    """The server and this SDK share no protocol version (docs/guides/sdk.md: version policy): refused by the
    server on Register, or by the SDK on the server's Register or Status reply. The message names
    both ends' versions."""


def incompatible_server(target: str, server: versions.Versions | None) -> IncompatibleVersionError | None:
    """The error for a server whose versions (None: it sent none, from before versions) share no
    protocol with this SDK's; None when they share one."""
    refusal = versions.incompatibility(server or versions.LEGACY, versions.THIS)
    if refusal is None:
        return None
    code = grpc.StatusCode.FAILED_PRECONDITION
    return IncompatibleVersionError(f"{code.name}: {target}: {refusal}", code, Reason.INCOMPATIBLE_VERSION)


class UnauthenticatedError(GempsError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhaustedError(GempsError):
    """A limit was hit: message size, number of workers."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ServerBusyError(ResourceExhaustedError):
    """The server had its most RPCs in progress (its --max-concurrent-rpcs): retried, as when unreachable."""


class ServerUnavailableError(GempsError):
    """The server could not be reached, even after retrying."""

    code = grpc.StatusCode.UNAVAILABLE


class CallCancelledError(ServerUnavailableError):
    """The call ended CANCELLED, which this client never asks for (the primary watch, which ends
    calls itself, says so in its own words): what sat across it ended it, a server on its way out
    or a proxy between. Retried as when unreachable: every call is safe to make again (a commit is
    known by its request id)."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceededError(GempsError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CommitSupersededError(GempsError):
    """The server refused an attempt of a commit because a later commit of this client was applied
    first (reason `superseded`): an old attempt the network delivered late. Nothing was applied."""

    code = grpc.StatusCode.ABORTED


class StoppedError(GempsError):
    """The client's stop event was set while it waited to retry an unreachable server."""


class PartiallyAppliedError(GempsError):
    """A commit to partitions of θ that some applied and another refused (a commit is not atomic
    across partitions). `applied` and `refused` name them by partition index; `code` and `reason`
    are the first refusal's (`__cause__` is that error), and so is its class: raised as `of()`
    makes it, it is also an instance of the refusal's class, so that `except InvalidArgumentError`
    catches it as before. `central` is the client's copy of θ, in which the applying partitions'
    replies are already loaded (as `Client.central`)."""

    @classmethod
    def of(
        cls, refusal: GempsError, applied: Sequence[int], refused: Sequence[int], central: CentralVariable
    ) -> PartiallyAppliedError:
        kind = type(refusal)
        if kind not in _PARTIAL_CLASSES:
            _PARTIAL_CLASSES[kind] = type(f"PartiallyApplied{kind.__name__}", (cls, kind), {})
        return _PARTIAL_CLASSES[kind](refusal, applied, refused, central)

    def __init__(
        self, refusal: GempsError, applied: Sequence[int], refused: Sequence[int], central: CentralVariable
    ) -> None:
        count = len(applied) + len(refused)
        super().__init__(
            f"commit applied by partition{_plural(applied)} {_listed(applied)} of {count} and refused by "
            f"partition{_plural(refused)} {_listed(refused)}: {refusal.message}",
            refusal.code,
            refusal.reason,
        )
        self.applied = tuple(applied)
        self.refused = tuple(refused)
        self.central = central


_PARTIAL_CLASSES: dict[type[GempsError], type[PartiallyAppliedError]] = {}


def _listed(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices))


def _plural(indices: Sequence[int]) -> str:
    return "s" if len(indices) > 1 else ""


class NotRegisteredError(GempsError):
    """A worker call was made before `Client.register`."""


# How grpc.aio words its own refusals (there is no gemps reason in them); the server's own count
# of calls in progress refuses with the same words.
CONCURRENT_RPC_LIMIT = reasons.BUSY_DETAILS
MESSAGE_TOO_LARGE = "Received message larger than max"

_BY_CODE: dict[grpc.StatusCode, type[GempsError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        WorkerNotFoundError,
        FailedPreconditionError,
        UnauthenticatedError,
        ResourceExhaustedError,
        ServerUnavailableError,
        CallCancelledError,
        DeadlineExceededError,
        CommitSupersededError,
    )
    if cls.code is not None
}


_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


# Reasons that mean the server has no state for this worker: registering again fixes them.
FORGOTTEN_REASONS = frozenset({Reason.UNKNOWN_WORKER, Reason.NOT_INITIALIZED})


def from_rpc_error(error: grpc.RpcError) -> GempsError:
    """Translate a grpc error into the matching GempsError subclass."""
    if not isinstance(error, grpc.Call):
        return GempsError(str(error))
    reason = next((str(v) for k, v in error.trailing_metadata() or () if k == reasons.METADATA_KEY), "")
    return from_status(error.code(), error.details() or "", reason)


def from_status_number(number: int, details: str, reason: str = "") -> GempsError:
    """A refusal that names its gRPC status by number (the data plane's DataPlaneError)."""
    code = _CODES_BY_NUMBER.get(number)
    if code is None:
        return GempsError(f"status {number}: {details}", None, reason)
    return from_status(code, details, reason)


def from_status(code: grpc.StatusCode, details: str, reason: str = "") -> GempsError:
    """The GempsError subclass of a status code, with the server's reason label (one mapping,
    whichever way the refusal came)."""
    cls = _BY_CODE.get(code, GempsError)
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == Reason.INCOMPATIBLE_VERSION:
        cls = IncompatibleVersionError
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not reason:  # refused by gRPC itself, not gemps
        if details == CONCURRENT_RPC_LIMIT:
            cls = ServerBusyError
        elif MESSAGE_TOO_LARGE in details:
            details += (
                " (the server's --max-message-mb limits each request message; the SDK sends payloads "
                "past 1 MiB in pieces unless streaming='never')"
            )
    return cls(f"{code.name}: {details}", code, reason)


# Failures worth another attempt: the server is down, restarting, paused or overloaded.
RETRIED = (ServerUnavailableError, DeadlineExceededError, ServerBusyError)


def server_forgot_worker(error: GempsError) -> bool:
    return error.reason in FORGOTTEN_REASONS


def version_ahead(error: GempsError) -> bool:
    """A commit refused for its base version (the SDK sends none below zero), or an evaluation for
    its version: ahead of the server's. The server's history went back under the client: a
    failover to a replica that lacks commits it never acknowledged, though a pull had shown them,
    or a restart from a checkpoint older than what a pull had shown. Pulling θ again fixes it."""
    return error.reason == Reason.BAD_VERSION


def worth_another_attempt(error: GempsError) -> bool:
    """Whether a call that failed so may succeed when done again (after registering again, or
    pulling θ again)."""
    return isinstance(error, RETRIED) or server_forgot_worker(error) or version_ahead(error)


@contextlib.contextmanager
def gone_if_foreign(target: str) -> Iterator[None]:
    """A call to a server this client was registered with: UNIMPLEMENTED there means another gRPC
    service answers at its address now (whoever took its port since it died), raised as the
    server being unavailable, so the call is retried (and a follower looks it up again) instead of
    failing as though the server had refused it."""
    try:
        yield
    except GempsError as error:
        failure = foreign_as_gone(target, error)
        if failure is error:
            raise
        raise failure from None


def foreign_as_gone(target: str, error: GempsError, *, announced: bool = False) -> GempsError:
    """`error` of a call to a server this client was registered with, as gone_if_foreign raises it:
    UNIMPLEMENTED (another gRPC service) as the server being unavailable, anything else as it is.
    A server holding another job's θ (other_job: it refused a registration of this client's job)
    is so too: the address belongs to another job now, and the call goes on elsewhere (the next
    replica of a set), never registering there (DESIGN §3d, "One job, one θ").
    At an address partition 0 `announced` (not the user's), a spec that does not match is so too:
    partition 0 took the model, so that is another job's gemps server, which took the port of a
    partition that died (a restarted partition of this job holds the same slice)."""
    if error.code == grpc.StatusCode.UNIMPLEMENTED:
        what = f"another gRPC service ({error.message or 'UNIMPLEMENTED'})"
    elif error.reason == Reason.OTHER_JOB or (announced and error.reason == Reason.SPEC_MISMATCH):
        what = f"another job's gemps server ({error.message})"
    else:
        return error
    return ServerUnavailableError(
        f"UNAVAILABLE: {target} answers as {what}: the gemps server that was there is gone",
        ServerUnavailableError.code,
    )
