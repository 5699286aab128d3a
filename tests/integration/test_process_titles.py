"""A replicated job's processes tell apart in `ps` (issue 43, item 6): each replica's title names
its replica and role, and the role follows a failover; the supervisor says it supervises. Before,
every one of them read `python3 -m gemps_cli server`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from gemps_proto.status import ReplicationStatus
from gemps_server import process_title
from tests.etcd_server import require_etcd
from tests.helpers import server_config, wait_for
from tests.integration.test_replicas import replication_of
from tests.integration.test_servers_side_by_side import Servers, command_line, grpc_ports, servers

NO_REPLICATION = ReplicationStatus("", "", 0, 0)

__all__ = ["servers"]  # the fixture, used here by name


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def titles(supervisor: int) -> dict[int, str]:
    """Each gemps child's (not etcd's) title, by pid."""
    found = {}
    for child in children(supervisor):
        try:
            line = command_line(child)
        except FileNotFoundError:  # exited since
            continue
        if line.startswith("gemps server"):
            found[child] = line
    return found


def test_the_titles_of_a_replicated_job_follow_a_failover(servers: Servers) -> None:
    require_etcd()
    port, _ = grpc_ports(2)
    supervisor, _ports = servers.start(port, "--replicas", "2", "--replica-lease", "1")
    assert command_line(supervisor.pid) == f"gemps server supervisor replicas 2 :{port}"
    either = [
        {f"gemps server replica 0 {first} :{port}", f"gemps server replica 1 {second} :{port + 1}"}
        for first, second in (("primary", "backup"), ("backup", "primary"))  # whichever won the election
    ]
    wait_for(lambda: set(titles(supervisor.pid).values()) in either, 60, f"titles {either}")
    primary, title = next((pid, title) for pid, title in titles(supervisor.pid).items() if "primary" in title)
    survivor = 1 if "replica 0" in title else 0
    # Killed before its backup is seeded, the primary would be waited for (its backup lacks what
    # it held) until its restart, and either could win then: the backup in sync first.
    primary_target = f"127.0.0.1:{port + 1 - survivor}"
    wait_for(lambda: (replication_of(primary_target) or NO_REPLICATION).live == 2, 60, "the backup in sync")
    os.kill(primary, signal.SIGKILL)
    promoted = f"gemps server replica {survivor} primary :{port + survivor}"
    wait_for(lambda: promoted in titles(supervisor.pid).values(), 60, promoted)


@pytest.mark.parametrize(
    ("options", "role", "title"),
    [
        ({}, "", "gemps server :50051"),
        (
            {"partitions": 3, "partition_index": 2, "partition_addresses": "a,b,c"},
            "",
            "gemps server partition 2 :50051",
        ),
        (
            {"replicas": 2, "replica_index": 1, "etcd": "http://e:2379", "auth_token": "t"},
            "BACKUP",
            "gemps server replica 1 backup :50051",
        ),
    ],
)
def test_a_title_names_partition_replica_and_role(options: dict[str, object], role: str, title: str) -> None:
    config = server_config(port=50051, **options)
    assert process_title.server_title(config, 50051, role) == title
