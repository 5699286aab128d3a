"""gemps SDK: talk to a gemps parameter server from your own workers.

The core (Client, errors, records) needs only numpy and grpcio; `gemps.pytorch` adds the torch
helper and is imported only when you use it.
"""

from gemps.client import Client
from gemps.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    GempsError,
    InvalidArgumentError,
    NotRegisteredError,
    ResourceExhaustedError,
    ServerUnavailableError,
    StoppedError,
    UnauthenticatedError,
    WorkerNotFoundError,
)
from gemps.records import (
    CentralVariable,
    CommitResult,
    Evaluation,
    ParameterSpec,
    Registration,
    ServerStatus,
    Shard,
    TrainingConfig,
)
from gemps.retry import RetryPolicy

__version__ = "0.1.0"

__all__ = [
    "CentralVariable",
    "Client",
    "CommitResult",
    "DeadlineExceededError",
    "Evaluation",
    "FailedPreconditionError",
    "GempsError",
    "InvalidArgumentError",
    "NotRegisteredError",
    "ParameterSpec",
    "Registration",
    "ResourceExhaustedError",
    "RetryPolicy",
    "ServerStatus",
    "ServerUnavailableError",
    "Shard",
    "StoppedError",
    "TrainingConfig",
    "UnauthenticatedError",
    "WorkerNotFoundError",
]
