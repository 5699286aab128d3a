"""Which gRPC status each kind of refusal is: one table for both wires (the gRPC servicer sets
it on the call, the data plane sends its number in a DataPlaneError: `error_header`); a refusal
of the data plane's protocol core as the service's error (`error_of`); and a failure no refusal
names, an INTERNAL refusal on both (`internal`)."""

from __future__ import annotations

import logging
import traceback

import grpc

from gemps_proto.data_plane_events import ProtocolError
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from gemps_server.logs import event

#: the gRPC status of each kind of refusal
STATUS_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Aborted: grpc.StatusCode.ABORTED,
    Internal: grpc.StatusCode.INTERNAL,
}

log = logging.getLogger("gemps.server")
#: frames of an internal error's traceback logged: its innermost, where the bug is (a log field
#: holds at most logs.MAX_FIELD_CHARS, and keeps its start)
TRACE_FRAMES = 4


def status_of(error: ServiceError) -> grpc.StatusCode:
    return STATUS_CODES[type(error)]


def error_of(refused: ProtocolError) -> ServiceError:
    """A refusal of the protocol core as the service's error (what the gRPC path would raise)."""
    if refused.reason is Reason.TOO_LARGE:
        return ResourceExhausted(refused.message, refused.reason)
    if refused.reason is Reason.UNAUTHENTICATED:
        return Unauthenticated(refused.message, refused.reason)
    return InvalidArgument(refused.message, refused.reason)


def error_header(error: ServiceError) -> bytes:
    """A refusal as a DataPlaneError: what the gRPC path would have said (code, message, reason)."""
    message = pb.DataPlaneError(code=status_of(error).value[0], message=error.message, reason=error.reason.value)
    return message.SerializeToString()


def internal(method: str, failure: Exception) -> Internal:
    """The INTERNAL refusal of a request `method` failed on with `failure` (not a ServiceError: a
    bug), logged here with its traceback. Its client hears it at once instead of a dropped call or
    connection, which it would retry until its patience ran out."""
    said = f"{type(failure).__name__}: {failure}"
    trace = "".join(traceback.format_exception(failure, limit=-TRACE_FRAMES))  # the innermost: log fields are clipped
    failure.__traceback__ = None  # its frames hold the request (see grpc_servicer.rpc)
    event(log, "internal error", level=logging.ERROR, method=method, error=said, traceback=trace)
    return Internal(
        f"the server failed on this {method} ({said}); whether it took effect is unknown: the server's log "
        "has the traceback",
        Reason.INTERNAL,
    )
