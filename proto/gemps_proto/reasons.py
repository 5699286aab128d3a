"""Why the server refuses a request: one label per cause, shared by the server and every client.

A refused RPC carries its gRPC status code and, in the trailing metadata under `gemps-reason`,
one of these labels, so clients act on the cause without parsing messages (the SDK registers
again on `unknown_worker` and `not_initialized`). The server counts rejections by the same
labels in its metrics. A client in another language reads the label as a plain string.
"""

from __future__ import annotations

import enum

#: trailing-metadata key of a refused RPC's reason label
METADATA_KEY = "gemps-reason"
#: the details of a refusal past --max-concurrent-rpcs, sent without a reason label: grpc.aio's own
#: limiter refused so before the server counted calls itself, and clients recognise it by them
BUSY_DETAILS = "Concurrent RPC limit exceeded!"


class Reason(str, enum.Enum):
    """A refusal's cause. Members are strings, so `error.reason == "non_finite"` works too."""

    MALFORMED = "malformed"  # bytes that are not a valid message of the method's type
    UNAUTHENTICATED = "unauthenticated"  # missing or wrong bearer token
    REVOKED_CERTIFICATE = "revoked_certificate"  # a client certificate the server's --tls-crl lists
    REGISTRATION_RATE = "registration_rate"  # more registrations than the rate limit allows
    MAX_WORKERS = "max_workers"  # every worker slot is taken
    BAD_SPEC = "bad_spec"  # an empty, unnamed, repeated or negative-shaped parameter spec
    BAD_DTYPE = "bad_dtype"  # a dtype the central variable or the wire does not support
    SPEC_MISMATCH = "spec_mismatch"  # a spec that differs from the central variable's
    OTHER_JOB = "other_job"  # a client of another job than the one whose θ this server holds
    BAD_JOB = "bad_job"  # a job identity past its length limit or with characters outside [A-Za-z0-9_-]
    NOT_INITIALIZED = "not_initialized"  # no worker has set the central variable yet
    INITIALIZING = "initializing"  # another worker is setting the central variable: retry shortly
    UNKNOWN_WORKER = "unknown_worker"  # never registered, left, or evicted
    BAD_KIND = "bad_kind"  # a payload kind other than gradient or update, or one the server's rule does not take
    BAD_PAYLOAD = "bad_payload"  # tensor bytes that do not match their dtype and shape
    BAD_SHAPE = "bad_shape"  # a payload that is not flat [P]
    BAD_VERSION = "bad_version"  # a base version below zero; a commit's base or an evaluation's ahead of the server's
    NON_FINITE = "non_finite"  # NaN or Inf in a payload or in initial parameters
    BAD_REQUEST_ID = "bad_request_id"  # a request id past its length limit
    SUPERSEDED = "superseded"  # a late attempt of a commit its client has moved past (a later one was applied)
    BAD_CLIENT_ID = "bad_client_id"  # a client id past its length limit or with spaces or controls
    BAD_EVALUATION = "bad_evaluation"  # an evaluator's figures out of range
    BAD_GRADIENT_SUMS = "bad_gradient_sums"  # gradient sums no local steps have, or sent with a gradient commit
    TOO_LONG = "too_long"  # a worker name or dataset label past its length limit
    STREAM_IDLE = "stream_idle"  # a stream silent for --stream-idle-timeout, or slower than --min-stream-rate-mb
    TOO_LARGE = "too_large"  # a model of more values than the server's --max-parameters
    BUSY = "busy"  # past --max-concurrent-rpcs (on the wire as gRPC's own refusal: BUSY_DETAILS, no label)
    UNAUTHENTICATED_LIMIT = "unauthenticated_limit"  # calls that need no token past --max-unauthenticated-rpcs
    WATCH_LIMIT = "watch_limit"  # Health.Watch streams past --max-watches or --max-watches-per-connection
    NOT_PRIMARY = "not_primary"  # a replica that is not its partition's primary now: try another replica
    INCOMPATIBLE_VERSION = "incompatible_version"  # client and server share no protocol version
    MEMORY_BUDGET = "memory_budget"  # a registration whose rule state is past the server's --memory-budget-mb
    OUT_OF_MEMORY = "out_of_memory"  # the server could not allocate a registration's state: nothing was kept
    SHARED_MEMORY_LIMIT = "shared_memory_limit"  # shared memory past the server's --max-shared-memory (the socket then)
    BAD_WAIT = "bad_wait"  # a pull's wait_seconds below zero, not a number, or past MAX_PULL_WAIT_SECONDS
    INTERNAL = "internal"  # the server failed on a request it took (a bug, in its log): it may or may not have applied

    def __str__(self) -> str:
        return self.value


def parse(label: str) -> Reason | None:
    """The Reason a label names; None for a label this version does not know (or none)."""
    try:
        return Reason(label)
    except ValueError:
        return None
