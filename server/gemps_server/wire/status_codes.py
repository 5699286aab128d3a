"""Which gRPC status each kind of refusal is: one table for both wires (the gRPC servicer sets
it on the call, the data plane sends its number in a DataPlaneError)."""

from __future__ import annotations

import grpc

from gemps_server.domain.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)

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
}


def status_of(error: ServiceError) -> grpc.StatusCode:
    return STATUS_CODES[type(error)]
