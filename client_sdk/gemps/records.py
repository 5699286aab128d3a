"""Plain data the Client returns (no protobuf objects reach users).

The protocol's shared types (specs, the training config, shards, registrations, evaluations,
status) are gemps_proto.schema's and gemps_proto.status's, re-exported here; the two below exist
only on the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps.tied_names import expanded
from gemps_proto import vectors
from gemps_proto.gradient_sums import GradientSums
from gemps_proto.schema import (
    Buffers,
    Evaluation,
    Layout,
    ParameterSpec,
    Partition,
    Registration,
    Shard,
    TrainingConfig,
    unflatten,
)
from gemps_proto.status import BackupLag, GradientNoise, ReplicationStatus, ServerStatus, WorkerStatus
from gemps_proto.vectors import Vector


@dataclass(frozen=True)
class CentralVariable:
    """The central variable at one version: a flat read-only float32 vector plus its spec, and the
    model's buffers (state that is not trained, e.g. batch-norm running statistics) likewise: the
    float ones flat as float32 in `buffers`, the integer ones (`num_batches_tracked`) flat as int64
    in `integer_buffers`, each in buffer spec order; `named_buffers()` puts them together."""

    version: int
    flat: Vector
    spec: tuple[ParameterSpec, ...]
    buffers: Vector = field(default_factory=vectors.empty_float32)
    buffer_spec: tuple[ParameterSpec, ...] = ()
    # Each partition's version when θ is partitioned (`version` is partition 0's), else (version,).
    versions: tuple[int, ...] = ()
    integer_buffers: Vector = field(default_factory=vectors.empty_int64)

    def named(self) -> dict[str, Vector]:
        """Per-parameter views (no copy) in spec order."""
        return unflatten(self.flat, self.spec)

    def named_buffers(self) -> dict[str, Vector]:
        """Per-buffer views (no copy) in buffer spec order: float32, and int64 for integer buffers."""
        return Buffers(self.buffers, self.integer_buffers).named(self.buffer_spec)

    def state_dict(self) -> dict[str, Vector]:
        """Parameters and buffers by name: what `model.load_state_dict` takes (after torch.from_numpy).
        A tied or shared tensor is under each name it goes by (gemps.tied_names); `named()` and
        `named_buffers()` keep the spec's names."""
        return expanded({**self.named(), **self.named_buffers()})


@dataclass(frozen=True)
class CommitResult:
    version: int
    staleness: int
    scaling_mean: float
    parameters: CentralVariable
    scaling_median: float = 1.0
    scaling_at_zero: float = 0.0  # fraction of parameters GEM scaled by 0
    scaling_at_max: float = 0.0  # fraction clamped at pi_max
    # Per partition, the epoch of the primary that acknowledged it (replicated partitions; else 0s).
    epochs: tuple[int, ...] = ()
    # A rule that moves θ a round of commits at a time (adamw): the commits the round still needed
    # (the most of any partition's); `parameters` is then θ once it moved (gemps.rounds). Else 0.
    round_pending: int = 0


__all__ = [
    "BackupLag",
    "Buffers",
    "CentralVariable",
    "CommitResult",
    "Evaluation",
    "GradientNoise",
    "GradientSums",
    "Layout",
    "ParameterSpec",
    "Partition",
    "Registration",
    "ReplicationStatus",
    "ServerStatus",
    "Shard",
    "TrainingConfig",
    "WorkerStatus",
]
