"""The protocol's Python face (gemps_proto.schema, gemps_proto.status) against the .proto, and what derives from it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, get_type_hints

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from gemps_proto import reasons, schema, versions
from gemps_proto import schema_proto as shared
from gemps_proto.status import (
    BACKUP,
    PRIMARY,
    ROLES,
    BackupLag,
    GradientNoise,
    ReplicationStatus,
    Rounds,
    ServerStatus,
    WorkerStatus,
)
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.rules import rule_class, rule_names, training_problems, with_rule_defaults

# Python type of each protobuf scalar type the schema uses.
SCALARS = {
    FieldDescriptor.TYPE_DOUBLE: float,
    FieldDescriptor.TYPE_UINT32: int,
    FieldDescriptor.TYPE_UINT64: int,
    FieldDescriptor.TYPE_INT64: int,
    FieldDescriptor.TYPE_STRING: str,
    FieldDescriptor.TYPE_BOOL: bool,
    FieldDescriptor.TYPE_BYTES: bytes,
}
# Message fields the Python face leaves out on purpose (TrainingConfig's: deprecated, for peers from
# before rule_options; schema_proto writes and reads them).
WIRE_ONLY = {
    "RegisterResponse": {"parameters", "buffers", "integer_buffers", "history"},
    "TrainingConfig": {"momentum", "kappa", "pi_max", "worker_mode"},
}
FACES: list[tuple[type[Any], Any]] = [
    (schema.TrainingConfig, pb.TrainingConfig.DESCRIPTOR),
    (schema.ParameterSpec, pb.ParameterSpec.DESCRIPTOR),
    (schema.Shard, pb.Shard.DESCRIPTOR),
    (schema.Registration, pb.RegisterResponse.DESCRIPTOR),
    (schema.Evaluation, pb.EvaluationReport.DESCRIPTOR),
    (ServerStatus, pb.StatusResponse.DESCRIPTOR),
    (schema.Partition, pb.Partition.DESCRIPTOR),
    (schema.Layout, pb.Layout.DESCRIPTOR),
    (schema.DataPlane, pb.DataPlane.DESCRIPTOR),
    (GradientNoise, pb.GradientNoise.DESCRIPTOR),
    (ReplicationStatus, pb.ReplicationStatus.DESCRIPTOR),
    (BackupLag, pb.BackupLag.DESCRIPTOR),
    (versions.Versions, pb.Versions.DESCRIPTOR),
]


@pytest.mark.parametrize("face,message", FACES, ids=[face.__name__ for face, _ in FACES])
def test_each_schema_type_has_its_messages_fields(face: type[Any], message: Descriptor) -> None:
    wire = {f.name for f in message.fields} - WIRE_ONLY.get(message.name, set())
    assert {f.name for f in dataclasses.fields(face)} == wire
    hints = get_type_hints(face)
    for field in message.fields:
        if field.name in wire and field.type in SCALARS and not field.is_repeated:
            assert hints[field.name] is SCALARS[field.type], field.name


def test_a_shard_unpacks_as_index_and_count() -> None:
    """The SDK guide's `(index, count)`, without losing the record's fields, equality or frozenness."""
    shard = schema.Shard(2, 5)
    index, count = shard
    assert (index, count) == (shard.index, shard.count) == (2, 5)
    assert shard == schema.Shard(2, 5) != schema.Shard(5, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.index = 3  # type: ignore[misc]


def test_payload_kinds_are_the_wire_enum() -> None:
    named = {pb.PayloadKind.Name(v): v for v in pb.PayloadKind.values() if v != pb.PAYLOAD_KIND_UNSPECIFIED}
    assert {kind.wire_name: int(kind) for kind in schema.PayloadKind} == named
    assert [kind.label for kind in schema.PayloadKind] == ["gradient", "update"]


def test_worker_modes_are_the_worker_options_choices() -> None:
    """The mode is the reference worker's own option (`gemps worker --mode`), no longer the server's."""
    from gemps_worker.modes import WorkerMode
    from gemps_worker.training import WorkerOptions

    choices = next(f for f in dataclasses.fields(WorkerOptions) if f.name == "mode").metadata["choices"]
    assert tuple(mode.value for mode in WorkerMode) == choices


def test_training_config_and_status_survive_the_wire() -> None:
    config = schema.TrainingConfig(rule="momentum", learning_rate=0.1, rule_options={"kappa": 2.0}, batch_size=32)
    assert shared.training_config_from_proto(shared.training_config_to_proto(config)) == config
    status = ServerStatus(
        initialized=True,
        version=7,
        active_workers=2,
        num_parameters=10,
        config=config,
        commits_applied=7,
        commits_rejected=1,
        spec=(schema.ParameterSpec("w", (2, 5)),),
        uptime_seconds=3.5,
        last_evaluation=schema.Evaluation(6, 0.25, 0.875, 100, "digits"),
        learning_rate=0.025,
        buffer_spec=(schema.ParameterSpec("bn.running_mean", (5,)),),
        workers=(WorkerStatus("a", 0, 7, 1.5, 2.5), WorkerStatus("", 1, 0, 40.0, 40.0)),
        lease_ttl_seconds=60.0,
        gradient_noise=GradientNoise(2.5, 900.0, 64.0, windows=12, window=8),
        replication=ReplicationStatus(
            "r0",
            PRIMARY,
            epoch=5,
            replicas=3,
            backups=(BackupLag("r1", True, 0, 0.0), BackupLag("r2", False, 17, 1.25)),
            forwarded=400,
            applied=3,
            failovers=2,
        ),
        rounds=Rounds(closed=12, size=15, held=3),
    )
    assert shared.status_from_proto(shared.status_to_proto(status)) == status
    assert shared.status_from_proto(shared.status_to_proto(dataclasses.replace(status, rounds=None))).rounds is None
    assert shared.status_from_proto(shared.status_to_proto(dataclasses.replace(status, rounds=Rounds(0, 1, 0)))) == (
        dataclasses.replace(status, rounds=Rounds(0, 1, 0))  # a rule of rounds before its first: still said
    )
    assert shared.status_from_proto(shared.status_to_proto(dataclasses.replace(status, last_evaluation=None))) == (
        dataclasses.replace(status, last_evaluation=None)
    )


@pytest.mark.parametrize(
    ("rule", "options"),
    [("gem", {"momentum": 0.5, "kappa": 2.0, "pi_max": 3.0}), ("nesterov", {"momentum": 0.5}), ("downpour", {})],
)
def test_a_config_from_a_server_before_rule_options_has_its_rules_options(rule: str, options: dict[str, float]) -> None:
    """Such a server sent momentum, kappa and pi_max for every rule, and no map: each rule's are those it took."""
    old = pb.TrainingConfig(rule=rule, learning_rate=0.1, momentum=0.5, kappa=2.0, pi_max=3.0, worker_mode="agn")
    read = shared.training_config_from_proto(old)
    assert (read.rule, read.learning_rate, read.rule_options) == (rule, 0.1, options)


def test_a_peer_from_before_rule_options_reads_them_in_the_deprecated_fields() -> None:
    """And the worker mode it reads is "gradient": what its reference worker's `--mode server` then runs."""
    gem = schema.TrainingConfig(rule="gem", rule_options={"momentum": 0.5, "kappa": 2.0, "pi_max": 3.0})
    message = shared.training_config_to_proto(gem)
    assert (message.momentum, message.kappa, message.pi_max, message.worker_mode) == (0.5, 2.0, 3.0, "gradient")
    message = shared.training_config_to_proto(schema.TrainingConfig(rule="momentum", rule_options={"momentum": 0.5}))
    assert (message.momentum, message.kappa, message.pi_max) == (0.5, 0.0, 0.0)
    assert dict(message.rule_options) == {"momentum": 0.5}


def test_replication_survives_the_wire_and_is_absent_when_not_replicated() -> None:
    backup = ReplicationStatus("r1", BACKUP, epoch=5, replicas=3, primary="ps-0:50051", applied=40)
    message = pb.StatusResponse(replication=shared.replication_to_proto(backup))
    assert shared.replication_from_proto(message) == backup
    assert shared.replication_from_proto(pb.StatusResponse()) is None  # unset: not replicated
    # A record of near-default figures (R=1, no backups) still arrives as set, not as "not replicated".
    alone = ReplicationStatus("r0", PRIMARY, epoch=1, replicas=1)
    assert shared.replication_from_proto(pb.StatusResponse(replication=shared.replication_to_proto(alone))) == alone


def test_replication_status_counts_live_replicas_as_the_primary_sees_them() -> None:
    backups = (BackupLag("r1", True, 0, 0.0), BackupLag("r2", False, 9, 3.0))
    primary = ReplicationStatus("r0", PRIMARY, epoch=2, replicas=3, backups=backups)
    assert (primary.live, primary.under_replicated) == (2, True)
    assert dataclasses.replace(primary, replicas=2).under_replicated is False
    backup = ReplicationStatus("r1", BACKUP, epoch=2, replicas=3)
    assert (backup.live, backup.under_replicated) == (0, False)  # the primary's to say


def test_the_server_names_the_protocols_replication_record() -> None:
    from gemps_server.replication import status

    assert status.ReplicationStatus is ReplicationStatus and status.BackupLag is BackupLag
    assert (status.PRIMARY, status.BACKUP, status.CANDIDATE) == ROLES == ("primary", "backup", "candidate")


def test_training_config_problems_name_the_field() -> None:
    assert schema.TrainingConfig().problems() == []
    out_of_range = {"momentum": 1.0, "kappa": -1.0, "pi_max": 0.0}
    bad = schema.TrainingConfig(learning_rate=0.0, rule_options=out_of_range, batch_size=0)
    problems = " ".join(training_problems(bad))  # the server's check: its fields, then its rule's options
    for name in ("learning_rate", "momentum", "kappa", "pi_max", "batch_size"):
        assert name in problems
    from gemps import options
    from gemps_worker.training import WorkerOptions

    parser = argparse.ArgumentParser()
    options.add_arguments(parser, WorkerOptions)
    with pytest.raises(SystemExit):  # the worker's mode: its own flag's choices, gradient by default
        parser.parse_args(["--mode", "x"])
    assert options.from_sources(WorkerOptions, parser.parse_args([]), environ={}).mode == "gradient"


def test_flat_vectors_and_named_parameters_round_trip() -> None:
    import numpy as np

    named = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7.0], np.float32)}
    spec = schema.spec_of(named)
    assert spec == (schema.ParameterSpec("w", (2, 3)), schema.ParameterSpec("b", (1,)))
    back = schema.unflatten(schema.flatten(named), spec)
    assert list(back) == ["w", "b"] and all(np.array_equal(back[k], named[k]) for k in named)


def test_reasons_are_labels_clients_can_compare_as_strings() -> None:
    labels = [reason.value for reason in reasons.Reason]
    assert len(set(labels)) == len(labels) and all(label == label.lower() for label in labels)
    label: str = "non_finite"  # as a client in another language would hold it
    assert label == reasons.Reason.NON_FINITE and str(reasons.Reason.NON_FINITE) == label
    assert reasons.parse("unknown_worker") is reasons.Reason.UNKNOWN_WORKER
    assert reasons.parse("from a newer server") is None and reasons.parse("") is None


@pytest.mark.parametrize("name", rule_names())
def test_each_rule_takes_its_hyperparameters_from_the_training_config(name: str) -> None:
    taken = rule_class(name).hyperparameters()
    assert "learning_rate" in taken  # every rule turns a gradient into -eta * g
    # The config it is announced with carries each: a field, or the rule's option by its own name.
    assert set(taken) <= set(with_rule_defaults(schema.TrainingConfig(rule=name)).as_dict())
    assert rule_class(name).undeclared_options() == []  # each option is a constructor parameter


def test_rules_own_only_the_hyperparameters_they_use() -> None:
    assert rule_class("gem").hyperparameters() == ("learning_rate", "momentum", "kappa", "pi_max")
    assert rule_class("momentum").hyperparameters() == ("learning_rate", "momentum")
    assert rule_class("downpour").hyperparameters() == ("learning_rate",)


def test_a_layout_survives_the_wire() -> None:
    layout = schema.Layout(1, (schema.Partition("", 0, 6), schema.Partition(":50052", 6, 11)), 11)
    assert shared.layout_from_proto(pb.StatusResponse(layout=shared.layout_to_proto(layout))) == layout
    assert shared.layout_from_proto(pb.StatusResponse()) is None  # one server: no layout on the wire
