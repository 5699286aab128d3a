"""Why the server refuses a request, by kind: each kind is one gRPC status code, mapped in the
servicer (the only place that knows about gRPC); the `reason` is one of gemps_proto.reasons."""

from __future__ import annotations

from gemps_proto.reasons import Reason


class ServiceError(Exception):
    """A request the server refuses, with the reason clients and metrics see."""

    def __init__(self, message: str, reason: Reason) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class InvalidArgument(ServiceError):
    """The request's content is wrong (shape, dtype, NaN/Inf, version, ...)."""


class NotFound(ServiceError):
    """The worker is unknown (never registered, left, evicted)."""


class FailedPrecondition(ServiceError):
    """The server is not in a state to serve this (not initialised, spec mismatch)."""


class ResourceExhausted(ServiceError):
    """A limit was hit (workers, registration rate)."""


class DeadlineExceeded(ServiceError):
    """The client took too long (a stream that stopped sending while it held a buffer)."""


class Unavailable(ServiceError):
    """Not now, soon: the caller should retry with backoff (the central variable is being set)."""


class Aborted(ServiceError):
    """The request lost a race it cannot win: a late attempt of a commit its client has moved past."""


class Internal(ServiceError):
    """The server failed on a request it took (an exception no refusal names: a bug). Whether the
    request took effect is unknown; the server's log holds the traceback."""


class Unauthenticated(ServiceError):
    """The caller did not prove who it is (a data-plane ticket that is not its registration's)."""
