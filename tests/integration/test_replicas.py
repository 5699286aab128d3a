"""Replicated partitions on one machine (issue 35): real etcd, real servers, real replication
streams. Commits count themselves where counting is the point (updates of ones under `downpour`:
θ's values are the commits applied); GEM where bit-identical state is (its per-worker state is
the part most likely to drift). The faults between machines are in test_replica_faults.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gemps
from gemps_server.checkpoint_files import list_checkpoints, load
from gemps_server.domain import images
from gemps_server.replication import image_codec
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.status import BACKUP, PRIMARY, ReplicationStatus
from gemps_worker.cluster import ServerProcess
from tests.helpers import CommitLoops, InProcessServer, replication_secret_file, stop_process, wait_for
from tests.integration.conftest import StartServer, StartServerProcess

LEASE = 1.0  # seconds: short, so failovers in tests take about this long
PARAMETERS = 1000


def replica_options(etcd: LocalEtcd, index: int, job: str, **options: Any) -> dict[str, Any]:
    return {
        "replicas": 2,
        "replica_index": index,
        "etcd": etcd.endpoint,
        "job": job,
        "replication_port": 0,
        "replica_lease": LEASE,
        "replica_timeout": 2.0,
        "replication_secret_file": replication_secret_file(),
        **options,
    }


def status_of(server: InProcessServer) -> ReplicationStatus:
    status = server.server.replication.status()
    assert status is not None
    return status


def wait_replicated(servers: list[InProcessServer], timeout: float = 30.0) -> InProcessServer:
    """Until one server is primary and every other one is its backup, in sync and caught up; the primary."""

    def settled() -> bool:
        statuses = [status_of(server) for server in servers]
        primaries = [status for status in statuses if status.role == PRIMARY]
        if len(primaries) != 1 or sum(status.role == BACKUP for status in statuses) != len(servers) - 1:
            return False
        backups = primaries[0].backups
        return len(backups) == len(servers) - 1 and all(b.in_sync and b.lag_commits == 0 for b in backups)

    wait_for(
        settled, timeout, "one primary, every backup in sync", explain=lambda: repr([status_of(s) for s in servers])
    )
    return next(server for server in servers if status_of(server).role == PRIMARY)


def digest(server: InProcessServer) -> str:
    """The replica's whole state, hashed (taken on its applier: consistent at one version)."""
    inner = server.server
    take = functools.partial(images.take, inner.state)
    image = asyncio.run_coroutine_threadsafe(inner.applier.submit(take), server._loop).result(30)
    return image_codec.digest(image)


def commit_until_backup_matches(
    servers: list[InProcessServer], clients: list[gemps.Client], theta: np.ndarray, update: np.ndarray, commits: int
) -> tuple[InProcessServer, CommitLoops]:
    """Each client commits `update` `commits` times to the replicated `servers` and closes; then the
    backup holds its primary's version and state bit for bit. The backup and the loops."""
    primary = wait_replicated(servers)
    loops = CommitLoops(clients, {"w": theta}, update)
    loops.start().wait_each(commits, 60, f"{commits} commits per worker")
    loops.stop()
    for client in clients:
        client.close()
    assert not loops.failures, loops.failures
    wait_replicated(servers)
    backup = next(server for server in servers if server is not primary)
    assert primary.server.state.core.version == backup.server.state.core.version == sum(loops.acked)
    assert digest(primary) == digest(backup)
    return backup, loops


@pytest.mark.parametrize("gem_state", ["exact", "compact"])
def test_a_backup_holds_the_primarys_state_bit_for_bit_under_gem(
    start_server: StartServer, etcd: LocalEtcd, gem_state: str
) -> None:
    """Compact state too: its codes, scales, references and generations (a model of several of its
    4096-value blocks, 120 commits of 3 workers: references refreshed and offsets rebased)."""
    servers = [
        start_server(rule="gem", gem_state=gem_state, **replica_options(etcd, index, f"bits-{gem_state}"))
        for index in range(2)
    ]
    target = "|".join(server.target for server in servers)
    rng = np.random.default_rng(0)
    clients = [gemps.Client(target, name=f"w{i}") for i in range(3)]
    size = 10 * PARAMETERS
    update = rng.standard_normal(size).astype(np.float32)
    backup, loops = commit_until_backup_matches(servers, clients, np.zeros(size, np.float32), update, 40)
    assert status_of(backup).applied >= sum(loops.acked)


def test_a_primary_that_stops_hands_over_and_no_commit_is_lost_or_applied_twice(
    start_server: StartServer, etcd: LocalEtcd
) -> None:
    servers = [start_server(rule="downpour", **replica_options(etcd, index, "handover")) for index in range(2)]
    primary = wait_replicated(servers)
    backup = next(server for server in servers if server is not primary)
    target = "|".join(server.target for server in servers)
    clients = [gemps.Client(target, name=f"w{i}") for i in range(4)]
    ones = np.ones(PARAMETERS, np.float32)
    loops = CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, ones, kind="update").start()
    loops.wait_each(20, 60, "20 commits per worker")
    with gemps.Client(target, name="epochs") as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        before = client.commit(ones, kind="update").epochs
        primary.stop(grace=1.0)  # resigns: the backup takes over without waiting for the lease
        loops.wait_each(20, 60, "20 more commits per worker, at the backup")
        after = client.commit(ones, kind="update").epochs
    loops.stop()
    assert not loops.failures, loops.failures
    assert status_of(backup).role == PRIMARY
    # Every reply carries the epoch of the primary that acknowledged it: the new one's is later.
    assert after == (status_of(backup).epoch,) and before[0] < after[0]
    theta = backup.server.state.core.theta_copy()
    assert theta.min() == theta.max() == backup.server.state.core.version == sum(loops.acked) + 2


def replica_process(start: StartServerProcess, etcd: LocalEtcd, index: int, job: str, **options: Any) -> ServerProcess:
    return start(**replica_options(etcd, index, job, **{"rule": "downpour", **options}))


def replication_of(target: str) -> ReplicationStatus | None:
    with gemps.Client(target, timeout=5) as client:
        return client.status().replication


def role_of(target: str) -> str:
    replication = replication_of(target)
    return "" if replication is None else replication.role


def primary_and_backup(
    start: StartServerProcess, etcd: LocalEtcd, job: str, **options: Any
) -> tuple[ServerProcess, ServerProcess, str]:
    """Two replica processes (with `options`), once one is primary and the other its backup, seeded
    and in sync (a backup's role comes before its seed; under load that took seconds): (primary,
    backup, the target workers are given)."""
    servers = [replica_process(start, etcd, index, job, **options) for index in range(2)]
    targets = [server.target for server in servers]

    def in_sync() -> bool:
        statuses = [replication_of(target) for target in targets]
        return sum(status is not None and status.role == BACKUP for status in statuses) == 1 and any(
            status is not None and status.role == PRIMARY and status.live == 2 for status in statuses
        )

    def statuses() -> str:
        return repr([replication_of(target) for target in targets])

    wait_for(in_sync, 30, "a primary and its backup in sync", explain=statuses)
    primary = next(server for server in servers if role_of(server.target) == PRIMARY)
    return primary, next(server for server in servers if server is not primary), "|".join(targets)


def counting(target: str, workers: int, timeout: float) -> CommitLoops:
    """`workers` clients committing updates of ones (θ counts the commits applied), started."""
    clients = [gemps.Client(target, name=f"w{i}", timeout=timeout) for i in range(workers)]
    ones = np.ones(PARAMETERS, np.float32)
    return CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, ones, kind="update").start()


def test_sigkill_of_the_primary_loses_no_acknowledged_commit(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """8 workers commit; the primary's process is SIGKILLed: every acknowledged commit is in the
    promoted backup's θ exactly once, and commits are acknowledged again within seconds. Each
    worker says so once, not at every refusal while it goes round the replicas."""
    caplog.set_level(logging.WARNING, logger="gemps.client")
    primary, survivor, target = primary_and_backup(start_server_process, etcd, "sigkill")
    workers = 8
    loops = counting(target, workers=workers, timeout=5)
    loops.wait_each(10, 60, "10 commits per worker")
    os.kill(primary.pid, signal.SIGKILL)
    killed = time.monotonic()
    loops.wait_each(5, 60, "5 more commits per worker, at the promoted backup")
    resumed = time.monotonic() - killed
    planes = [client.planes for client in loops.clients]  # before they leave
    loops.stop()
    assert not loops.failures, loops.failures
    with gemps.Client(survivor.target, timeout=5) as observer:
        status = observer.status()
        theta = observer.pull().flat
    assert status.replication is not None and status.replication.role == PRIMARY
    assert theta.min() == theta.max() == status.version == sum(loops.acked)
    # The workers went on on the data plane: their tickets open the promoted backup's too.
    assert planes == [["data"]] * workers
    print(f"SIGKILL of the primary: {sum(loops.acked)} acknowledged, all applied once; resumed within {resumed:.1f} s")
    assert resumed < 15 * LEASE
    # At most two moves worth a warning per worker: to the primary at registration, to the new one.
    moved = [r for r in caplog.records if r.levelno == logging.WARNING and "following it" in r.getMessage()]
    assert 0 < len(moved) <= 2 * workers, [r.getMessage() for r in moved]


def test_adamws_rounds_go_on_at_the_promoted_backup_after_a_sigkill(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """The recipe for many AdamW workers (`--rule adamw`: a round of every worker's gradient, then
    one AdamW step) under replication: the primary is SIGKILLed in the middle of the rounds. The
    promoted backup holds the open round as the primary did (its sum, its workers), so every
    acknowledged commit counts once, the workers' waits for their round end there, and none runs
    out (the SDK's WARNING: a round stood until its wait's limit)."""
    caplog.set_level(logging.WARNING, logger="gemps")
    primary, survivor, target = primary_and_backup(start_server_process, etcd, "rounds", rule="adamw")
    workers = 4
    clients = [gemps.Client(target, name=f"w{i}", timeout=5) for i in range(workers)]
    loops = CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, np.ones(PARAMETERS, np.float32)).start()
    loops.wait_each(1, 60, "every worker registered")
    loops.wait_each(6, 60, "6 rounds of the 4")
    os.kill(primary.pid, signal.SIGKILL)
    killed_at = [list(epochs) for epochs in loops.epochs]
    loops.wait_each(6, 60, "6 more rounds, at the promoted backup")
    loops.stop()
    assert not loops.failures, loops.failures
    with gemps.Client(survivor.target, timeout=5) as observer:
        status = observer.status()
    assert status.replication is not None and status.replication.role == PRIMARY
    assert status.version == sum(loops.acked)  # each acknowledged commit applied once, none lost
    assert all(len(set(epochs)) == 1 for epochs in killed_at)  # the first 6 rounds at one primary
    assert [epochs[-1] for epochs in loops.epochs] == [status.replication.epoch] * workers
    stood = [r.getMessage() for r in caplog.records if r.name == "gemps.rounds" and r.levelno >= logging.WARNING]
    assert not stood, stood


def test_a_backup_paused_past_the_timeout_is_dropped_then_reseeded(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """The backup is SIGSTOPped: commits wait for it until --replica-timeout, then it is dropped
    (the primary says under-replicated) and commits go on without it; after SIGCONT it is re-seeded
    and in sync again, and nothing acknowledged meanwhile is lost."""
    primary, backup, target = primary_and_backup(start_server_process, etcd, "pause")

    def replication() -> ReplicationStatus:
        with gemps.Client(primary.target, timeout=5) as observer:
            status = observer.status().replication
        assert status is not None
        return status

    loops = counting(target, workers=2, timeout=10)
    loops.wait_each(10, 60, "10 commits per worker")
    # In sync when it stops: on a loaded machine a backup late for the timeout is dropped and
    # re-seeded on its own, and commits acknowledged then would prove nothing about the pause.
    wait_for(lambda: not replication().under_replicated, 30, "the backup in sync", explain=lambda: repr(replication()))
    stop_process(backup.pid)
    stopped = time.monotonic()
    try:
        wait_for(lambda: replication().under_replicated, 30, "the stopped backup dropped from the in-sync set")
        dropped = time.monotonic() - stopped
        loops.wait_each(20, 30, "commits acknowledged while the backup is stopped (after it was dropped)")
    finally:
        os.kill(backup.pid, signal.SIGCONT)
    print(f"the stopped backup was dropped {dropped:.1f} s after SIGSTOP (--replica-timeout 2)")
    wait_for(lambda: not replication().under_replicated, 30, "the backup re-seeded and in sync again")
    loops.wait_each(5, 30, "commits with the backup back")
    loops.stop()
    assert not loops.failures, loops.failures
    with gemps.Client(primary.target, timeout=5) as observer:
        version = observer.status().version
    assert version == sum(loops.acked)


def test_a_backup_checkpoints_what_it_applies(start_server: StartServer, etcd: LocalEtcd, tmp_path: Path) -> None:
    """A backup counts the commits it applies from its primary towards --checkpoint-every, so a job
    whose every replica restarts resumes from the newest state any of them held."""
    servers = [
        start_server(
            rule="downpour",
            checkpoint_dir=str(tmp_path / f"replica-{index}"),
            checkpoint_every=10,
            **replica_options(etcd, index, "checkpoints"),
        )
        for index in range(2)
    ]
    primary = wait_replicated(servers)
    backup = next(server for server in servers if server is not primary)
    with gemps.Client("|".join(server.target for server in servers), name="w") as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        for _ in range(35):
            client.commit(np.ones(PARAMETERS, np.float32), kind="update")
    folder = tmp_path / f"replica-{servers.index(backup)}"
    wait_for(lambda: any(v >= 30 for v, _ in list_checkpoints(folder)), 30, "the backup's checkpoint of version 30")
    # Each carries the epoch its commits were acknowledged under: the primary's (the newest state
    # of a job restarted whole is told by (epoch, version)).
    epoch = status_of(primary).epoch
    assert epoch > 0 and {load(path).epoch for _, path in list_checkpoints(folder)} == {epoch}
    assert {load(path).epoch for _, path in list_checkpoints(tmp_path / f"replica-{servers.index(primary)}")} == {epoch}


def test_both_partitions_primaries_killed_at_once_the_workers_follow_both(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """θ in 2 partitions, each replicated: both primaries are SIGKILLed at once (one machine holding
    both). Partition 0 cannot say where partition 1 is now (its primary is gone too): the client
    goes round partition 1's replicas itself, and every commit completes on both."""

    def start(partition: int, replica: int, addresses: str = "") -> ServerProcess:
        options = {"partition_addresses": addresses} if addresses else {}
        return replica_process(
            start_server_process, etcd, replica, "both", partitions=2, partition_index=partition, **options
        )

    ones = [start(1, replica) for replica in range(2)]
    announced = ",".join(["", "|".join(server.target for server in ones)])
    zeros = [start(0, replica, announced) for replica in range(2)]

    def roles_settled() -> bool:
        return all(sorted(role_of(s.target) for s in replicas) == [BACKUP, PRIMARY] for replicas in (zeros, ones))

    wait_for(roles_settled, 30, "a primary and a backup of each partition")
    primaries = [next(s for s in replicas if role_of(s.target) == PRIMARY) for replicas in (zeros, ones)]
    # Each call's deadline spans both failovers (about two leases each; more on a loaded host).
    loops = counting("|".join(server.target for server in zeros), workers=3, timeout=15)
    loops.wait_each(10, 60, "10 commits per worker")

    def backups_in_sync() -> bool:
        """A backup that is not in sync is never promoted (it may lack acknowledged commits): under
        load, a backup's seed came after its role and 10 commits, and partition 0 then had no
        primary for good, which is right. The test is of two failovers, so both are in sync first."""
        return all((status := replication_of(server.target)) is not None and status.live == 2 for server in primaries)

    wait_for(backups_in_sync, 30, "each partition's backup in sync with its primary")
    for server in primaries:
        os.kill(server.pid, signal.SIGKILL)
    loops.wait_each(5, 60, "5 more commits per worker, at both promoted backups")
    loops.stop()
    assert not loops.failures, loops.failures
    with gemps.Client("|".join(server.target for server in zeros), timeout=5) as observer:
        versions = [status.version for status in observer.statuses()]
        theta = observer.pull().flat
    assert versions == [sum(loops.acked)] * 2
    assert theta.min() == theta.max() == sum(loops.acked)
