"""gemps SDK: talk to a gemps parameter server from your own workers.

The core (Client, errors, records) needs only grpcio and protobuf: θ comes as numpy arrays where
numpy is installed, else as float32 memoryviews (gemps_proto.vectors); `gemps.pytorch` adds the
torch helper and is imported only when you use it. `gemps.options` builds configuration dataclasses
from flags and GEMPS_* variables, for your own workers as for gemps' commands.
"""

import importlib.metadata
from typing import TYPE_CHECKING, Any

from gemps import grpc_logs  # noqa: F401  first: gRPC's C core reads its verbosity when grpc is imported
from gemps.errors import (
    CallCancelledError,
    CommitSupersededError,
    DeadlineExceededError,
    FailedPreconditionError,
    GempsError,
    IncompatibleVersionError,
    InvalidArgumentError,
    NamedPayloadError,
    NotRegisteredError,
    PartiallyAppliedError,
    ResourceExhaustedError,
    ServerBusyError,
    ServerUnavailableError,
    StoppedError,
    UnauthenticatedError,
    WorkerNotFoundError,
)
from gemps.records import (
    BackupLag,
    CentralVariable,
    CommitResult,
    Evaluation,
    GradientNoise,
    GradientSums,
    ParameterSpec,
    Registration,
    ReplicationStatus,
    ServerStatus,
    Shard,
    TrainingConfig,
    WorkerStatus,
)
from gemps.retry import RetryPolicy
from gemps_proto.reasons import Reason

if TYPE_CHECKING:
    from gemps.client import Client

__version__ = importlib.metadata.version("gemps")  # pyproject.toml's, the one definition

__all__ = [
    "BackupLag",
    "CallCancelledError",
    "CentralVariable",
    "Client",
    "CommitResult",
    "CommitSupersededError",
    "DeadlineExceededError",
    "Evaluation",
    "FailedPreconditionError",
    "GempsError",
    "GradientNoise",
    "GradientSums",
    "IncompatibleVersionError",
    "InvalidArgumentError",
    "NamedPayloadError",
    "NotRegisteredError",
    "ParameterSpec",
    "PartiallyAppliedError",
    "Reason",
    "Registration",
    "ReplicationStatus",
    "ResourceExhaustedError",
    "RetryPolicy",
    "ServerBusyError",
    "ServerStatus",
    "ServerUnavailableError",
    "Shard",
    "StoppedError",
    "TrainingConfig",
    "UnauthenticatedError",
    "WorkerNotFoundError",
    "WorkerStatus",
]


def __getattr__(name: str) -> Any:
    """`Client` is imported when first used: every gemps command imports this package (its options,
    errors and records), a server among them, and most use no client (its transports were a tenth of
    a server's start-up)."""
    if name != "Client":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global Client
    from gemps.client import Client

    return Client


def __dir__() -> list[str]:
    return sorted([*globals(), "Client"])
