"""etcd loses its data (restarted empty on the same endpoint), and no acknowledged commit is lost,
no epoch used twice (issue 41; docs/DESIGN.md §3d, "when etcd loses its data"): real etcd, real
elections, and real replica processes with workers committing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gemps
from gemps_server.replication import local_etcd
from gemps_server.replication.election import Election, Member, new_incarnation
from gemps_server.replication.epoch_record import EpochRecord
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.recovery import Held
from gemps_server.replication.status import PRIMARY, ReplicationStatus
from gemps_worker.cluster import ServerProcess
from tests.etcd_server import etcd_server
from tests.helpers import stop_process, wait_for
from tests.integration.conftest import StartServerProcess
from tests.integration.test_replicas import counting, primary_and_backup

LEASE = 2.0  # seconds: etcd's shortest lease is about that anyway
EXPIRY = LEASE + 3.0  # etcd checks for expired leases every half second, and revokes through raft
NAMES = ("r0", "r1")


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    """An etcd of this test's own: the test restarts it empty."""
    with etcd_server() as running:
        yield running


def restart_empty(etcd: LocalEtcd) -> None:
    """etcd loses everything: stopped, its data removed, and a new empty one started on the same
    client endpoint (the replicas keep theirs). Its revisions start again at 1."""
    endpoint = etcd.endpoint
    etcd.stop()
    ports = [urlsplit(endpoint).port]
    free = local_etcd._free_port
    with pytest.MonkeyPatch.context() as patch:  # the client port is pinned; the peer port is any free one
        patch.setattr(local_etcd, "_free_port", lambda host="127.0.0.1": ports.pop() if ports else free(host))
        etcd.start()
    assert etcd.endpoint == endpoint


def bump_revisions(election: Election, count: int) -> None:
    """Writes that raise etcd's revision (so that an epoch counted from revisions alone is high
    before the loss, and low after it)."""
    key = f"{election.prefix}/filler"
    for _ in range(count):
        election._call("put", lambda client: client.put(key, "x"))


class Replica:
    """One election with its record on disk and a state the test sets."""

    def __init__(self, etcd: LocalEtcd, prefix: str, name: str, folder: Path, held: Held = (0, 0)) -> None:
        self.held = held
        me = Member(name, new_incarnation(), f"127.0.0.1:{5000 + NAMES.index(name)}", "127.0.0.1:6000")
        self.election = Election(
            etcd.endpoint,
            prefix,
            me,
            lease_seconds=LEASE,
            replicas=NAMES,
            record=EpochRecord(folder / name),
            held=lambda: self.held,
        )


@pytest.fixture
def replicas(etcd: LocalEtcd, tmp_path: Path) -> Iterator[list[Replica]]:
    prefix = f"/gemps/test-{uuid.uuid4().hex[:8]}/partition/0"
    made = [Replica(etcd, prefix, name, tmp_path) for name in NAMES]
    yield made
    for replica in made:
        replica.election.close()


def test_a_dropped_backup_never_becomes_primary_after_etcd_lost_its_data(
    etcd: LocalEtcd, replicas: list[Replica]
) -> None:
    """The primary dropped its backup from the in-sync set and acknowledged more; etcd restarts
    empty and the primary pauses. The stale backup sees no primary and no in-sync list (what a fresh
    job looks like), yet never campaigns: it waits, saying for whom. Once the old primary is back
    it is demoted (its lease is gone), reports, and takes over at an epoch above its old one."""
    primary, backup = (replica.election for replica in replicas)
    bump_revisions(primary, 40)
    backup.announce()  # a fresh job: a primary is chosen once every replica reported
    old = primary.campaign()
    assert old is not None and backup.primary() == (primary.me, old)
    backup.saw(old)
    assert primary.set_in_sync([backup.me]) and primary.set_in_sync([])  # seeded, then dropped
    replicas[0].held, replicas[1].held = (old, 500), (old, 300)  # acknowledged 300..500 alone
    primary.announce()
    backup.announce()

    restart_empty(etcd)  # and the primary is paused: it neither renews nor reports
    deadline = time.monotonic() + 2 * EXPIRY
    while time.monotonic() < deadline:
        backup.announce()
        assert backup.primary() is None
        assert backup.campaign() is None, "the stale backup became primary"
        time.sleep(LEASE / 4)
    assert backup.unavailable.missing == ("r0",) and "r0" in backup.unavailable.reason

    assert not primary.renew() and primary.epoch is None  # resumed: its lease died with etcd's data
    primary.announce()
    backup.announce()
    assert backup.campaign() is None  # every replica reported, and the old primary holds more
    new = primary.campaign()
    assert new is not None and new > old  # though etcd's revisions started again at 1
    assert backup.primary() == (primary.me, new) and backup.unavailable.reason == ""
    assert primary.in_sync() == [primary.me.identity]


def test_epochs_increase_across_etcd_restarted_empty_when_every_replica_restarted_too(
    etcd: LocalEtcd, replicas: list[Replica], tmp_path: Path
) -> None:
    """Every replica process restarts (new incarnations, their states from checkpoints) and etcd
    lost its data: their records on disk keep the next epoch above every epoch used before."""
    first, second = (replica.election for replica in replicas)
    bump_revisions(first, 40)
    second.announce()
    old = first.campaign()
    assert old is not None
    second.saw(old)
    first.resign()
    for replica in replicas:
        replica.election.close()
    restart_empty(etcd)
    prefix = first.prefix
    restarted = [Replica(etcd, prefix, name, tmp_path, held=(old, 10)) for name in NAMES]
    try:
        assert [replica.election.record.seen for replica in restarted] == [old, old]
        for replica in restarted:
            replica.election.announce()
        epochs = [replica.election.campaign() for replica in restarted]
        won = [epoch for epoch in epochs if epoch is not None]
        assert len(won) == 1 and won[0] > old, epochs
    finally:
        for replica in restarted:
            replica.election.close()


def scrape(metrics_port: int, name: str) -> float:
    """A gauge's value on a server's metrics page (its one series)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        page = response.read().decode()
    (value,) = [sample.value for family in text_string_to_metric_families(page) for sample in family.samples
                if sample.name == name]  # fmt: skip
    return value


def test_replicas_lose_no_acknowledged_commit_when_etcd_restarts_empty_while_a_backup_is_dropped(
    start_server_process: StartServerProcess, etcd: LocalEtcd, tmp_path: Path
) -> None:
    """Real replica processes and workers: the backup is SIGSTOPped until the primary drops it and
    acknowledges more without it; etcd restarts empty; the primary is SIGSTOPped and the backup
    resumed. The stale backup stays a candidate, saying why (metric, status, ERROR line), until the
    primary resumes; then a primary is elected at a higher epoch, and θ holds every acknowledged
    commit exactly once."""
    primary, backup, target = primary_and_backup(
        lambda **options: start_server_process(checkpoint_dir=str(tmp_path / str(options["replica_index"])), **options),
        etcd,
        "etcd-loss",
    )

    def replication(server: ServerProcess) -> ReplicationStatus:
        with gemps.Client(server.target, timeout=5) as observer:
            status = observer.status().replication
        assert status is not None
        return status

    old, name = replication(primary).epoch, replication(primary).name
    loops = counting(target, workers=2, timeout=30)
    loops.wait_each(10, 60, "10 commits per worker")
    wait_for(lambda: not replication(primary).under_replicated, 30, "the backup in sync")
    stop_process(backup.pid)
    try:
        wait_for(lambda: replication(primary).under_replicated, 30, "the stopped backup dropped")
        loops.wait_each(20, 30, "commits acknowledged by the primary alone")
        restart_empty(etcd)
        stop_process(primary.pid)
    finally:
        os.kill(backup.pid, signal.SIGCONT)
    try:
        deadline = time.monotonic() + 5.0  # five of these replicas' leases: before, it took over within two
        while time.monotonic() < deadline:
            assert replication(backup).role != PRIMARY, "the stale backup became primary"
            time.sleep(0.2)
        assert scrape(backup.metrics_port, "gemps_replication_waiting_for_replicas") == 1
        assert f"waiting for {name}" in replication(backup).unavailable
        shown = subprocess.run(
            [sys.executable, "-m", "gemps_cli", "status", "--server", backup.target],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert "UNAVAILABLE: no primary" in shown and name in shown
        assert "unavailable: no primary" in backup.log(), backup.log()[-3000:]
    finally:
        os.kill(primary.pid, signal.SIGCONT)
    loops.wait_each(10, 60, "commits acknowledged again once the old primary is back")
    loops.stop()
    assert not loops.failures, loops.failures
    # The old primary takes over, or the backup once the resumed primary re-seeded it (then it
    # holds the same state, and they tied): either way at a new epoch, with every commit.
    now = next(server for server in (primary, backup) if replication(server).role == PRIMARY)
    assert replication(now).epoch > old
    with gemps.Client(now.target, timeout=5) as observer:
        theta = observer.pull().flat
        version = observer.status().version
    assert theta.min() == theta.max() == version == sum(loops.acked)
    # The backup's gauge follows its own replication loop, which may not have turned since the
    # takeover (a loaded run read 1 here once): it must come down, not have come down already.
    wait_for(
        lambda: scrape(backup.metrics_port, "gemps_replication_waiting_for_replicas") == 0,
        15,
        "the backup's waiting-for-replicas gauge back at 0",
    )
    print(f"etcd restarted empty: {sum(loops.acked)} acknowledged, all applied once; "
          f"{'the old primary' if now is primary else 'the re-seeded backup'} took over at epoch "
          f"{replication(now).epoch} (was {old})")  # fmt: skip
