from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
from gemps_cli import server

from gemps_server.config import (
    CheckpointOptions,
    ConnectionLimits,
    CoordinationOptions,
    DataPlaneLimits,
    ListenOptions,
    ObservabilityOptions,
    PartitionOptions,
    ReplicationOptions,
    RequestLimits,
    SecurityOptions,
    ServerConfig,
    TrainingOptions,
    WorkerOptions,
)
from tests.helpers import server_config


def test_defaults_match_the_design() -> None:
    t = server.parse_config([], environ={}).training
    mu, kappa, pi_max = (t.rule_options[name] for name in ("momentum", "kappa", "pi_max"))
    assert (t.rule, t.learning_rate, mu, kappa, pi_max, t.batch_size) == ("gem", 0.05, 0.9, 1.0, 5.0, 64)


def test_flag_beats_environment_beats_default() -> None:
    env = {"GEMPS_LEARNING_RATE": "0.1", "GEMPS_RULE": "downpour", "GEMPS_PORT": "6000"}
    c = server.parse_config(["--rule", "momentum"], environ=env)
    assert c.training.rule == "momentum"  # flag
    assert c.training.learning_rate == 0.1 and c.port == 6000  # environment
    assert c.training.rule_options == {"momentum": 0.9}  # default: the momentum rule's one option


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="GEMPS_MAX_WORKERS='lots' is not a valid max_workers"):
        server.parse_config([], environ={"GEMPS_MAX_WORKERS": "lots"})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rule": "sync"}, "unknown rule 'sync'"),
        ({"momentum": 1.0}, "momentum 1.0 is outside [0, 1)"),
        ({"learning_rate": 0.0}, "learning_rate 0.0 is outside (0, "),
        ({"port": 70000}, "port 70000 is outside [0, 65535]"),
        ({"lease_ttl": -1.0}, "lease_ttl -1.0 is outside (0, "),
    ],
)
def test_invalid_values_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        server_config(**overrides)


def test_unknown_choice_on_the_command_line_exits() -> None:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rule", "sync"])


def test_compiled_kernel_asked_for_where_it_was_not_built_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gemps_server.config.training

    monkeypatch.setattr(gemps_server.config.training, "compiled", None)  # as on a machine without a C compiler
    with pytest.raises(ValueError, match="gem_kernel 'compiled' is not built here"):
        server_config(gem_kernel="compiled")
    assert server_config(gem_kernel="auto").gem_kernel == "auto"  # auto falls back to numpy instead


# The option groups in the order of their flags in `gemps server --help`.
GROUPS = (
    TrainingOptions,
    ListenOptions,
    PartitionOptions,
    ReplicationOptions,
    CoordinationOptions,
    WorkerOptions,
    RequestLimits,
    DataPlaneLimits,
    ObservabilityOptions,
    CheckpointOptions,
    SecurityOptions,
    ConnectionLimits,
)


def test_the_server_config_is_its_option_groups_with_their_fields_in_order() -> None:
    grouped = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert [f.name for f in dataclasses.fields(ServerConfig)] == [*grouped, "supervisor_pid"]
    config = ServerConfig()
    assert all(isinstance(config, group) for group in GROUPS)  # a function of one group takes the config


def test_each_option_group_checks_its_own_options() -> None:
    assert ListenOptions(data_plane="maybe").problems() == ["data_plane 'maybe': choose on or off"]
    assert PartitionOptions(partitions=2, partition_index=0).problems() == [
        "partition 0 of several announces the layout: give partition_addresses"
    ]
    assert ReplicationOptions(replicas=2, replica_index=0).problems() == [
        "a replica of a replicated partition needs etcd to tell it its role: give etcd (e.g. http://etcd:2379)"
    ]
    assert ReplicationOptions(replicas=2, job="a/b").problems() == [
        "job 'a/b': letters, digits, '-' and '_' only (it names keys in etcd)"
    ]
    assert ReplicationOptions(replicas=2, min_in_sync=3).problems() == [
        "min_in_sync 3 is more than the 2 replicas: at most 2"
    ]


def test_the_in_sync_floor_is_half_the_replicas_rounded_up_unless_given() -> None:
    """--min-in-sync 0 (the default): 1 of 1 or 2, 2 of 3 or 4, 3 of 5; a value given is used as is."""
    floors = [ReplicationOptions(replicas=r).in_sync_floor for r in (1, 2, 3, 4, 5)]
    assert floors == [1, 1, 2, 2, 3]
    assert ReplicationOptions(replicas=2, min_in_sync=2).in_sync_floor == 2
    assert ReplicationOptions(replicas=3, min_in_sync=1).in_sync_floor == 1
    assert SecurityOptions(tls_client_ca="/nowhere/ca.pem").problems() == [
        "tls_client_ca (mutual TLS) needs tls_cert and tls_key",
        "tls_client_ca '/nowhere/ca.pem' is not a readable file",
    ]
    assert ConnectionLimits(max_watches=4, max_watches_per_connection=5).problems() == [
        "max_watches_per_connection must be at most max_watches (4)"
    ]
    assert ObservabilityOptions(log_format="xml").problems() == ["unknown log_format 'xml' (choose from text, json)"]
    assert WorkerOptions(gem_kernel="fast").problems() == [
        "unknown gem_kernel 'fast' (choose from auto, compiled, numpy)"
    ]


def test_checks_across_groups_are_the_server_configs(tmp_path: Path) -> None:
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("PEM")
    tls = {"tls_cert": str(tmp_path / "cert.pem"), "tls_key": str(tmp_path / "key.pem")}
    secret = tmp_path / "replication.secret"
    secret.write_text("s" * 32)
    with pytest.raises(ValueError, match=re.escape("replicas with TLS need --tls-client-ca")):
        server_config(replicas=2, **tls)
    assert server_config(replicas=2, tls_client_ca=tls["tls_cert"], **tls).replicas == 2
    # One problem of the replicas at a time: the replica's role first, then its credential and TLS,
    # then the job's name.
    with pytest.raises(ValueError, match=re.escape("replica_index 3 outside -1..1")):
        server_config(replicas=2, replica_index=3, **tls)
    alone = {"replicas": 2, "replica_index": 1, "etcd": "http://etcd:2379"}
    with pytest.raises(ValueError, match=re.escape("replica 1 started alone has no credential")):
        server_config(**alone, **tls)
    assert server_config(**alone, auth_token="t0ken").replica_index == 1
    assert server_config(**alone, replication_secret_file=str(secret)).replica_index == 1
    with pytest.raises(ValueError, match=re.escape("replication_secret_file '/nowhere' is not a readable file")):
        server_config(**alone, replication_secret_file="/nowhere")
    with pytest.raises(ValueError, match=re.escape("replicas with TLS need --tls-client-ca")):
        server_config(replicas=2, job="a/b", **tls)
    with pytest.raises(ValueError, match=re.escape("data_port 65534 + 2 (the last partition's) is past 65535")):
        server_config(partitions=3, data_port=65534)
    assert server_config(partitions=3, partition_index=1, partition_addresses="a,b,c", data_port=65534).partition == 1
