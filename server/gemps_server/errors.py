"""Service errors, each tied to its gRPC status code; the servicer maps them in one place."""

from __future__ import annotations

import grpc

# Trailing-metadata key carrying `ServiceError.reason`, so clients can act on it without
# parsing messages (e.g. re-register on "unknown_worker" or "not_initialized").
REASON_METADATA_KEY = "gemps-reason"


class ServiceError(Exception):
    """A request the server refuses. `reason` is a short label for metrics and logs."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
