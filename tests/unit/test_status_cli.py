"""`gemps status` on replicated partitions, against in-memory servers whose Status reports
replication records built by hand (the replication itself is tested where it lives)."""

from __future__ import annotations

import argparse

import pytest
from gemps_cli import status as status_command
from gemps_cli.main import main as gemps_main

import gemps
from gemps.records import BackupLag, ReplicationStatus
from gemps.retry import NO_RETRY
from gemps_proto.status import BACKUP, CANDIDATE, PRIMARY
from tests.unit.memory_transport import MemoryServer, connector, memory_cluster

IN_SYNC = BackupLag("r1", in_sync=True, lag_commits=0, lag_seconds=0.0)
LAGGING = BackupLag("r2", in_sync=False, lag_commits=40, lag_seconds=12.5)


def shown(
    servers: list[MemoryServer],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str = "",
) -> str:
    """What `gemps status --server <target, by default the first>` prints."""

    def connect(args: argparse.Namespace, timeout: float, retry: object = None) -> gemps.Client:
        if args.server not in {server.target for server in servers}:  # a primary named, not running here
            raise gemps.ServerUnavailableError(f"UNAVAILABLE: nothing at {args.server}")
        return gemps.Client(args.server, retry=NO_RETRY, connect=connector(servers))

    monkeypatch.setattr(status_command, "connect", connect)
    assert gemps_main(["status", "--server", target or servers[0].target]) == 0
    return capsys.readouterr().out


def test_an_under_replicated_primary_shows_its_backups_lag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = memory_cluster(4, partitions=1)
    server.replication = ReplicationStatus("r0", PRIMARY, epoch=7, replicas=3, backups=(IN_SYNC, LAGGING))
    out = shown([server], monkeypatch, capsys)
    assert "\nreplication     primary r0, epoch 7, 2/3 replicas live UNDER-REPLICATED\n" in out
    assert "\n  backup r1               in sync      lag 0 commits, 0.0s\n" in out
    assert "\n  backup r2               OUT OF SYNC  lag 40 commits, 12s\n" in out


def test_a_fully_replicated_primary_is_not_flagged(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = memory_cluster(4, partitions=1)
    server.replication = ReplicationStatus("r0", PRIMARY, epoch=7, replicas=2, backups=(IN_SYNC,))
    out = shown([server], monkeypatch, capsys)
    assert "\nreplication     primary r0, epoch 7, 2/2 replicas live\n" in out
    assert "UNDER-REPLICATED" not in out


def test_a_backup_names_the_primary_it_follows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = memory_cluster(4, partitions=1)
    server.replication = ReplicationStatus("r1", BACKUP, epoch=7, replicas=3, primary="ps-0:50051")
    out = shown([server], monkeypatch, capsys)
    assert "\nreplication     backup r1, epoch 7, follows ps-0:50051 (3 replicas configured)\n" in out


def test_a_backup_reached_sends_status_to_its_primary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first address given reached a backup: its primary, one of the addresses given, is asked,
    and its view shown (the backups' lag and under-replication are only the primary's to say)."""
    backup, primary = MemoryServer("memory:7000"), MemoryServer("memory:7001")
    backup.replication = ReplicationStatus("r1", BACKUP, epoch=7, replicas=3, primary=primary.target)
    primary.replication = ReplicationStatus("r0", PRIMARY, epoch=7, replicas=3, backups=(IN_SYNC, LAGGING))
    out = shown([backup, primary], monkeypatch, capsys, target=f"{backup.target}|{primary.target}")
    expected = (
        "replication     primary r0, epoch 7, 2/3 replicas live UNDER-REPLICATED "
        "(at memory:7001: the address given reached a backup)\n"
        "  backup r1               in sync      lag 0 commits, 0.0s\n"
        "  backup r2               OUT OF SYNC  lag 40 commits, 12s\n"
    )
    assert expected in out


def test_each_partition_shows_its_replica(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    servers = memory_cluster(4, partitions=3)
    servers[0].replication = ReplicationStatus("p0-a", PRIMARY, epoch=2, replicas=2, backups=(LAGGING,))
    servers[1].replication = ReplicationStatus("p1-b", CANDIDATE, epoch=3, replicas=2)
    out = shown(servers, monkeypatch, capsys)
    expected = (
        "replication     by partition (the replica each partition's address reached, or its primary)\n"
        "  0  primary p0-a, epoch 2, 1/2 replicas live UNDER-REPLICATED\n"
        "       backup r2               OUT OF SYNC  lag 40 commits, 12s\n"
        "  1  candidate p1-b, epoch 3, no primary known (2 replicas configured)\n"
        "  2  not replicated\n"
    )
    assert expected in out


def test_nothing_is_said_of_replication_when_no_partition_is_replicated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shown(memory_cluster(4, partitions=2), monkeypatch, capsys)
    assert "version" in out and "replicat" not in out.lower()


def test_a_replica_waiting_for_others_to_report_says_why_there_is_no_primary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = memory_cluster(4, partitions=1)
    why = "no primary: etcd holds no in-sync list ...; waiting for partition-0-replica-0"
    server.replication = ReplicationStatus("r1", CANDIDATE, epoch=7, replicas=2, unavailable=why)
    out = shown([server], monkeypatch, capsys)
    assert "\nreplication     candidate r1, epoch 7, no primary known (2 replicas configured)\n" in out
    assert f"\n  UNAVAILABLE: {why}\n" in out


def test_a_primary_whose_in_sync_floor_holds_commits_says_so_above_its_backups(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = memory_cluster(4, partitions=1)
    why = "no commit is acknowledged until r1 (disconnected) or another backup applies it: --min-in-sync 2 keeps ..."
    backups = (BackupLag("r1", True, 12, 7.5),)
    server.replication = ReplicationStatus("r0", PRIMARY, epoch=4, replicas=2, backups=backups, unavailable=why)
    out = shown([server], monkeypatch, capsys)
    assert f"primary r0, epoch 4, 2/2 replicas live\n  UNAVAILABLE: {why}\n  backup r1" in out
