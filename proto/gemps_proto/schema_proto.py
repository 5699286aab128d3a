"""The schema's plain types to their gemps.v1 messages and back: paired to_proto / from_proto functions.

The server and the SDK each have their own serde for the messages only they build; what both
read and write (parameter specs, the training config, shards, registrations, evaluations and
status) is converted here, once. How θ itself crosses the wire is gemps_proto.grpc_framing's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

from google.protobuf.message import Message

from gemps_proto import vectors
from gemps_proto.gradient_sums import GradientSums
from gemps_proto.rule_options import LEGACY_NAMES, legacy_options
from gemps_proto.schema import (
    Buffers,
    DataPlane,
    Evaluation,
    Layout,
    ParameterSpec,
    Partition,
    Registration,
    Shard,
    TrainingConfig,
)
from gemps_proto.status import (
    BackupLag,
    GradientNoise,
    RecentCommits,
    ReplicationStatus,
    RestoredCheckpoint,
    Rounds,
    ServerStatus,
    WorkerStatus,
)
from gemps_proto.tensor_codec import FLOAT32, EncodedBuffers, EncodedTensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.vectors import Vector
from gemps_proto.versions import Versions, received

M = TypeVar("M", bound=Message)


def tensor_to_proto(array: Vector) -> pb.Tensor:
    """A Tensor of an array's values (converted to little-endian float32 when needed)."""
    return pb.Tensor(
        dtype=pb.DTYPE_FLOAT32, shape=vectors.shape(array), data=bytes(vectors.little_endian_float32(array))
    )


def tensor_from_proto(tensor: pb.Tensor) -> EncodedTensor:
    """A Tensor's parts, decoded on demand (its bytes field is read once: each read copies it)."""
    return EncodedTensor(tensor.dtype, tuple(tensor.shape), tensor.data)


def set_buffers(floats: pb.Tensor, integers: pb.Tensor, buffers: Buffers) -> None:
    """A message's pair of buffer tensors (`buffers` and `integer_buffers`, or the initial or delta
    pair), each set whole: small. A kind the model has none of stays unset."""
    if vectors.size(buffers.floats):
        floats.CopyFrom(tensor_to_proto(vectors.flat(buffers.floats)))
    if vectors.size(buffers.integers):
        count = vectors.size(buffers.integers)
        integers.CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_INT64, shape=[count], data=vectors.little_endian_int64(buffers.integers))
        )


def buffers_from_proto(message: Message, floats: str, integers: str) -> EncodedBuffers | None:
    """A message's pair of buffer tensors, by field name; None when it has neither."""
    found = [
        tensor_from_proto(getattr(message, name)) if message.HasField(name) else None for name in (floats, integers)
    ]
    return None if found == [None, None] else EncodedBuffers(*found)


def spec_to_proto(spec: Iterable[ParameterSpec]) -> list[pb.ParameterSpec]:
    return [pb.ParameterSpec(name=entry.name, shape=entry.shape, dtype=entry.dtype) for entry in spec]  # type: ignore[arg-type]


def spec_from_proto(messages: Iterable[pb.ParameterSpec]) -> tuple[ParameterSpec, ...]:
    """Names, shapes and dtypes (unspecified: float32): whether the entries are valid is the
    server's to check."""
    return tuple(ParameterSpec(message.name, tuple(message.shape), message.dtype or FLOAT32) for message in messages)


# What a peer from before rule_options reads in their place (the .proto's deprecated fields).
_LEGACY_WORKER_MODE = "gradient"


def training_config_to_proto(config: TrainingConfig) -> pb.TrainingConfig:
    """The message, with the deprecated fields an older peer reads set from the rule's options."""
    message = pb.TrainingConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(TrainingConfig)})
    for name in LEGACY_NAMES:
        if name in config.rule_options:
            setattr(message, name, config.rule_options[name])
    message.worker_mode = _LEGACY_WORKER_MODE
    return message


def training_config_from_proto(message: pb.TrainingConfig) -> TrainingConfig:
    """The config, the rule's options by name (a map's order on the wire is protobuf's); from a
    server before rule_options (no map), from the deprecated fields it sent instead."""
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(TrainingConfig)}
    fields["rule_options"] = dict(sorted(message.rule_options.items()))
    if not message.rule_options:
        fields["rule_options"] = legacy_options(message.rule, {n: getattr(message, n) for n in LEGACY_NAMES})
    return TrainingConfig(**fields)


def shard_to_proto(shard: Shard) -> pb.Shard:
    return pb.Shard(index=shard.index, count=shard.count, shared_with=shard.shared_with)


def shard_from_proto(message: pb.Shard) -> Shard:
    return Shard(message.index, message.count, message.shared_with)


def layout_to_proto(layout: Layout | None) -> pb.Layout | None:
    if layout is None:
        return None
    return pb.Layout(
        index=layout.index,
        partitions=[pb.Partition(address=p.address, start=p.start, stop=p.stop) for p in layout.partitions],
        num_parameters=layout.num_parameters,
    )


def layout_from_proto(message: pb.RegisterResponse | pb.StatusResponse) -> Layout | None:
    """The message's layout, None when it has none (one server holds all of θ)."""
    if not message.HasField("layout"):
        return None
    layout = message.layout
    partitions = tuple(Partition(p.address, p.start, p.stop) for p in layout.partitions)
    return Layout(layout.index, partitions, layout.num_parameters)


def data_plane_to_proto(data_plane: DataPlane | None) -> pb.DataPlane | None:
    if data_plane is None:
        return None
    return pb.DataPlane(port=data_plane.port, ticket=data_plane.ticket, local_socket=data_plane.local_socket)


def data_plane_from_proto(message: pb.RegisterResponse | pb.StatusResponse) -> DataPlane | None:
    """The data plane a Register reply offers (a Status reply: says, with no ticket); None: none."""
    if not message.HasField("data_plane"):
        return None
    offer = message.data_plane
    return DataPlane(offer.port, offer.ticket, offer.local_socket)


def versions_to_proto(versions: Versions) -> pb.Versions:
    return pb.Versions(software=versions.software, protocol=versions.protocol, oldest_protocol=versions.oldest_protocol)


def versions_from_proto(message: pb.RegisterRequest | pb.RegisterResponse | pb.StatusResponse) -> Versions | None:
    """The versions a message carries; None when it has none (a peer from before versions)."""
    if not message.HasField("versions"):
        return None
    sent = message.versions
    return received(sent.software, sent.protocol, sent.oldest_protocol)


def registration_to_proto(registration: Registration) -> pb.RegisterResponse:
    """The reply without the central variable's values (the server adds them when due)."""
    return pb.RegisterResponse(
        worker_id=registration.worker_id,
        lease_ttl_seconds=registration.lease_ttl_seconds,
        config=training_config_to_proto(registration.config),
        shard=shard_to_proto(registration.shard),
        version=registration.version,
        initialized_central=registration.initialized_central,
        layout=layout_to_proto(registration.layout),
        data_plane=data_plane_to_proto(registration.data_plane),
        versions=None if registration.versions is None else versions_to_proto(registration.versions),
        job=registration.job,
    )


def registration_from_proto(message: pb.RegisterResponse) -> Registration:
    return Registration(
        worker_id=message.worker_id,
        lease_ttl_seconds=message.lease_ttl_seconds,
        config=training_config_from_proto(message.config),
        shard=shard_from_proto(message.shard),
        version=message.version,
        initialized_central=message.initialized_central,
        layout=layout_from_proto(message),
        data_plane=data_plane_from_proto(message),
        versions=versions_from_proto(message),
        job=message.job,
    )


def evaluation_to_proto(evaluation: Evaluation) -> pb.EvaluationReport:
    return pb.EvaluationReport(**dataclasses.asdict(evaluation))


def evaluation_from_proto(message: pb.EvaluationReport) -> Evaluation:
    return Evaluation(**{f.name: getattr(message, f.name) for f in dataclasses.fields(Evaluation)})


def replication_to_proto(replication: ReplicationStatus | None) -> pb.ReplicationStatus | None:
    if replication is None:
        return None
    return pb.ReplicationStatus(
        name=replication.name,
        role=replication.role,
        epoch=replication.epoch,
        replicas=replication.replicas,
        primary=replication.primary,
        backups=[pb.BackupLag(**dataclasses.asdict(backup)) for backup in replication.backups],
        forwarded=replication.forwarded,
        applied=replication.applied,
        failovers=replication.failovers,
        unavailable=replication.unavailable,
    )


def replication_from_proto(message: pb.StatusResponse) -> ReplicationStatus | None:
    """The replica's replication status; None when the partition is not replicated (unset)."""
    if not message.HasField("replication"):
        return None
    replication = message.replication
    return ReplicationStatus(
        name=replication.name,
        role=replication.role,
        epoch=replication.epoch,
        replicas=replication.replicas,
        primary=replication.primary,
        backups=tuple(
            BackupLag(**{f.name: getattr(backup, f.name) for f in dataclasses.fields(BackupLag)})
            for backup in replication.backups
        ),
        forwarded=replication.forwarded,
        applied=replication.applied,
        failovers=replication.failovers,
        unavailable=replication.unavailable,
    )


def status_to_proto(status: ServerStatus) -> pb.StatusResponse:
    return pb.StatusResponse(
        initialized=status.initialized,
        version=status.version,
        active_workers=status.active_workers,
        num_parameters=status.num_parameters,
        config=training_config_to_proto(status.config),
        commits_applied=status.commits_applied,
        commits_rejected=status.commits_rejected,
        spec=spec_to_proto(status.spec),
        uptime_seconds=status.uptime_seconds,
        last_evaluation=None if status.last_evaluation is None else evaluation_to_proto(status.last_evaluation),
        learning_rate=status.learning_rate,
        buffer_spec=spec_to_proto(status.buffer_spec),
        gradient_noise=pb.GradientNoise(**dataclasses.asdict(status.gradient_noise)),
        layout=layout_to_proto(status.layout),
        workers=[
            pb.WorkerStatus(**{**dataclasses.asdict(worker), "recent": recent_to_proto(worker.recent)})
            for worker in status.workers
        ],
        lease_ttl_seconds=status.lease_ttl_seconds,
        replication=replication_to_proto(status.replication),
        data_plane=data_plane_to_proto(status.data_plane),
        versions=None if status.versions is None else versions_to_proto(status.versions),
        memory_budget_bytes=status.memory_budget_bytes,
        rule_state_bytes=status.rule_state_bytes,
        recent=recent_to_proto(status.recent),
        gem_state=status.gem_state,
        worker_state_bytes=status.worker_state_bytes,
        shared_rule_state_bytes=status.shared_rule_state_bytes,
        restored=None if status.restored is None else pb.RestoredCheckpoint(**dataclasses.asdict(status.restored)),
        job=status.job,
        rounds=None if status.rounds is None else pb.Rounds(**dataclasses.asdict(status.rounds)),
    )


def status_from_proto(message: pb.StatusResponse) -> ServerStatus:
    return ServerStatus(
        initialized=message.initialized,
        version=message.version,
        active_workers=message.active_workers,
        num_parameters=message.num_parameters,
        config=training_config_from_proto(message.config),
        commits_applied=message.commits_applied,
        commits_rejected=message.commits_rejected,
        spec=spec_from_proto(message.spec),
        uptime_seconds=message.uptime_seconds,
        last_evaluation=(
            evaluation_from_proto(message.last_evaluation) if message.HasField("last_evaluation") else None
        ),
        learning_rate=message.learning_rate,
        buffer_spec=spec_from_proto(message.buffer_spec),
        gradient_noise=GradientNoise(
            **{field.name: getattr(message.gradient_noise, field.name) for field in dataclasses.fields(GradientNoise)}
        ),
        layout=layout_from_proto(message),
        workers=tuple(
            WorkerStatus(
                **{f.name: getattr(worker, f.name) for f in dataclasses.fields(WorkerStatus) if f.name != "recent"},
                recent=recent_from_proto(worker.recent),
            )
            for worker in message.workers
        ),
        lease_ttl_seconds=message.lease_ttl_seconds,
        replication=replication_from_proto(message),
        data_plane=data_plane_from_proto(message),
        versions=versions_from_proto(message),
        memory_budget_bytes=message.memory_budget_bytes,
        rule_state_bytes=message.rule_state_bytes,
        recent=recent_from_proto(message.recent),
        gem_state=message.gem_state,
        worker_state_bytes=message.worker_state_bytes,
        shared_rule_state_bytes=message.shared_rule_state_bytes,
        restored=(
            RestoredCheckpoint(message.restored.version, message.restored.path)
            if message.HasField("restored")
            else None
        ),
        job=message.job,
        rounds=(
            Rounds(message.rounds.closed, message.rounds.size, message.rounds.held)
            if message.HasField("rounds")
            else None
        ),
    )


def recent_to_proto(recent: RecentCommits) -> pb.RecentCommits:
    return pb.RecentCommits(**dataclasses.asdict(recent))


def recent_from_proto(message: pb.RecentCommits) -> RecentCommits:
    """An unset message (a server from before it) reads as no commits over no time."""
    return RecentCommits(**{field.name: getattr(message, field.name) for field in dataclasses.fields(RecentCommits)})


def gradient_sums_to_proto(sums: GradientSums) -> pb.GradientSums:
    return pb.GradientSums(**dataclasses.asdict(sums))


def gradient_sums_from_proto(request: pb.CommitRequest) -> GradientSums | None:
    """The request's sums; None when it carries none."""
    if not request.HasField("gradient_sums"):
        return None
    sums = request.gradient_sums
    return GradientSums(**{field.name: getattr(sums, field.name) for field in dataclasses.fields(GradientSums)})
