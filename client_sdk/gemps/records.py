"""Plain data returned by the Client (no protobuf objects leak to users)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gemps_proto.v1 import parameter_server_pb2 as pb


@dataclass(frozen=True)
class ParameterSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def to_proto(self) -> pb.ParameterSpec:
        return pb.ParameterSpec(name=self.name, shape=self.shape, dtype=pb.DTYPE_FLOAT32)

    @classmethod
    def from_proto(cls, message: pb.ParameterSpec) -> ParameterSpec:
        return cls(message.name, tuple(message.shape))


@dataclass(frozen=True)
class TrainingConfig:
    rule: str
    learning_rate: float
    momentum: float
    kappa: float
    pi_max: float
    worker_mode: str
    batch_size: int

    @classmethod
    def from_proto(cls, message: pb.TrainingConfig) -> TrainingConfig:
        return cls(
            message.rule,
            message.learning_rate,
            message.momentum,
            message.kappa,
            message.pi_max,
            message.worker_mode,
            message.batch_size,
        )


@dataclass(frozen=True)
class Shard:
    index: int
    count: int  # 0: use the whole training set, shuffled with a seed derived from `index`


@dataclass(frozen=True)
class Registration:
    worker_id: str
    lease_ttl_seconds: float
    config: TrainingConfig
    shard: Shard
    version: int


@dataclass(frozen=True)
class CentralVariable:
    """The central variable at one version: a flat read-only float32 vector plus its spec."""

    version: int
    flat: np.ndarray
    spec: tuple[ParameterSpec, ...]

    def named(self) -> dict[str, np.ndarray]:
        """Per-parameter views (no copy) in spec order."""
        out, offset = {}, 0
        for s in self.spec:
            out[s.name] = self.flat[offset : offset + s.size].reshape(s.shape)
            offset += s.size
        return out


@dataclass(frozen=True)
class CommitResult:
    version: int
    staleness: int
    scaling_mean: float
    parameters: CentralVariable
    scaling_median: float = 1.0
    scaling_at_zero: float = 0.0  # fraction of parameters GEM scaled by 0
    scaling_at_max: float = 0.0  # fraction clamped at pi_max


@dataclass(frozen=True)
class Evaluation:
    version: int
    loss: float
    accuracy: float
    num_samples: int
    dataset: str


@dataclass(frozen=True)
class ServerStatus:
    initialized: bool
    version: int
    active_workers: int
    num_parameters: int
    config: TrainingConfig
    commits_applied: int
    commits_rejected: int
    spec: tuple[ParameterSpec, ...]
    uptime_seconds: float
    last_evaluation: Evaluation | None

    @classmethod
    def from_proto(cls, message: pb.StatusResponse) -> ServerStatus:
        e = message.last_evaluation
        evaluation = (
            Evaluation(e.version, e.loss, e.accuracy, e.num_samples, e.dataset)
            if message.HasField("last_evaluation")
            else None
        )
        return cls(
            message.initialized,
            message.version,
            message.active_workers,
            message.num_parameters,
            TrainingConfig.from_proto(message.config),
            message.commits_applied,
            message.commits_rejected,
            tuple(ParameterSpec.from_proto(s) for s in message.spec),
            message.uptime_seconds,
            evaluation,
        )


def spec_of(parameters: Mapping[str, np.ndarray]) -> tuple[ParameterSpec, ...]:
    return tuple(ParameterSpec(name, tuple(np.shape(value))) for name, value in parameters.items())


def flatten(parameters: Mapping[str, np.ndarray]) -> np.ndarray:
    """Concatenate named arrays, in mapping order, into one float32 vector."""
    if not parameters:
        return np.empty(0, dtype=np.float32)
    return np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1) for v in parameters.values()])
