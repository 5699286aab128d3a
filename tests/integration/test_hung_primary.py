"""A replicated partition's workers through what a replica does short of dying (issue 61, items 1
and 2). A primary that stops without dying (item 1): SIGSTOP stands in for a long GC pause,
swap or a frozen VM. It neither answers nor closes its connections (its kernel still acknowledges
and answers keepalives), so workers with the SDK's defaults waited for it until their attempt
deadline (40-60 s) though its backup was primary after the lease. Now they ask the other replicas
while an attempt waits and follow the one that took over: acknowledged again within 2 s of the
promotion, on every route, every acknowledged commit applied once.

A primary paused while its backup is out of sync (dropped, or not seeded yet) must be waited for:
the backup lacks commits only the paused primary holds. Under a loaded suite a backup not seeded
yet took over after five leases (the rule for a job whose in-sync replicas all died) and the
acknowledged commits were gone.

A primary paused past its lease and resumed says it is no longer primary from its first answer
(issue 77, item 9), not from its coordinator's next renewal."""

from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.reasons import Reason
from gemps_proto.schema_proto import replication_from_proto
from gemps_proto.status import CANDIDATE, PRIMARY
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.replication.election import ORPHANED_LEASES
from gemps_server.replication.local_etcd import LocalEtcd
from tests.helpers import CommitLoops, scrape_series, stop_process, wait_for
from tests.integration.conftest import StartServerProcess, open_stub
from tests.integration.test_failover_workers import reason_of
from tests.integration.test_replicas import LEASE, PARAMETERS, primary_and_backup, replication_of, role_of

pytestmark = pytest.mark.usefixtures("plane")

#: the issue's bound: workers acknowledged again this long after the backup's promotion at most
RESUMES_WITHIN = 2.0
#: how long the paused primary stays paused in the last test: past the orphaned replicas' grace
PAUSED_FOR = ORPHANED_LEASES * LEASE + 4.0


def test_a_stopped_primary_does_not_stall_workers_with_the_sdks_defaults(
    start_server_process: StartServerProcess, etcd: LocalEtcd, plane: str
) -> None:
    primary, survivor, target = primary_and_backup(start_server_process, etcd, f"hung-{plane}")
    clients = [gemps.Client(target, name=f"w{i}") for i in range(3)]  # the defaults: no timeouts given
    ones = np.ones(PARAMETERS, np.float32)
    loops = CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, ones, kind="update").start()
    try:
        loops.wait_each(5, 60, "5 commits per worker")
        stop_process(primary.pid)
        wait_for(lambda: role_of(survivor.target) == PRIMARY, 30, "the backup promoted", poll=0.02)
        promoted = time.monotonic()
        loops.wait_each(1, 30, "a commit per worker at the promoted backup")
        resumed = time.monotonic() - promoted
    finally:
        loops.stop(timeout=30)
        os.kill(primary.pid, signal.SIGCONT)
    assert not loops.failures, loops.failures
    print(f"{plane}: acknowledged again {resumed:.2f} s after the promotion")
    assert resumed < RESUMES_WITHIN
    with gemps.Client(survivor.target, timeout=10) as observer:
        # θ and its version from one reply: a Status and a Pull may be answered by two replicas
        # (a pull follows the primary; the resumed primary is re-seeded meanwhile).
        pulled, replication = observer.pull(), observer.status().replication
    seen = f"θ {pulled.flat.min()}..{pulled.flat.max()} at version {pulled.version}, acknowledged {loops.acked}"
    seen += f", the survivor {replication}"
    assert pulled.flat.min() == pulled.flat.max() == pulled.version, seen
    assert pulled.version == sum(loops.acked), seen  # each acknowledged commit once


@pytest.mark.parametrize("plane", ["tcp"], indirect=True)
def test_a_paused_primary_whose_backup_is_out_of_sync_is_waited_for_and_loses_nothing(
    start_server_process: StartServerProcess, etcd: LocalEtcd, plane: str
) -> None:
    """The backup is paused until its primary drops it from the in-sync set and acknowledges commits
    alone; then the primary is paused and the backup resumed. The backup lacks those commits, so
    it must not take over however long the primary stays paused (a paused process is not a dead
    one); once the primary resumes it serves again and every acknowledged commit is in θ once."""
    primary, backup, target = primary_and_backup(start_server_process, etcd, "paused-out-of-sync")
    clients = [gemps.Client(target, name=f"w{i}") for i in range(2)]
    ones = np.ones(PARAMETERS, np.float32)
    loops = CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, ones, kind="update").start()
    try:
        loops.wait_each(3, 60, "3 commits per worker")
        stop_process(backup.pid)
        wait_for(lambda: _live(primary.target) == 1, 30, "the paused backup dropped from the in-sync set")
        loops.wait_each(3, 30, "3 commits per worker acknowledged by the primary alone")
        stop_process(primary.pid)
        os.kill(backup.pid, signal.SIGCONT)
        paused_until = time.monotonic() + PAUSED_FOR
        while time.monotonic() < paused_until:
            assert role_of(backup.target) != PRIMARY, "the backup that missed commits took over"
            time.sleep(0.2)
        os.kill(primary.pid, signal.SIGCONT)
        loops.wait_each(2, 60, "2 commits per worker once the primary resumed")
    finally:
        loops.stop(timeout=30)
        for server in (primary, backup):
            os.kill(server.pid, signal.SIGCONT)
    assert not loops.failures, loops.failures
    with gemps.Client(primary.target, timeout=10) as observer:
        pulled, replication = observer.pull(), observer.status().replication
    seen = f"θ {pulled.flat.min()}..{pulled.flat.max()} at version {pulled.version}, acknowledged {loops.acked}"
    assert replication is not None and replication.role == PRIMARY, f"{seen}, {replication}"
    assert pulled.flat.min() == pulled.flat.max() == pulled.version == sum(loops.acked), seen


def _live(target: str) -> int:
    replication = replication_of(target)
    return 0 if replication is None else replication.live


@pytest.mark.parametrize("plane", ["tcp"], indirect=True)
def test_a_resumed_ex_primary_answers_status_as_no_primary_before_it_hears_from_etcd(
    start_server_process: StartServerProcess, etcd: LocalEtcd, plane: str
) -> None:
    """Issue 77 item 9: a primary paused past its lease, its backup promoted meanwhile, answered
    Status right after it resumed as the primary of its old epoch with its old backup in sync (a
    watcher could follow it) until its coordinator's next renewal failed: one etcd round trip,
    here the etcd client's whole timeout, as etcd is paused while it resumes. Now its role is
    what its lease allows, read when Status is answered: not primary, no backups, in Status and
    in metrics; and a commit it is sent then is refused `not_primary`."""
    primary, backup, target = primary_and_backup(start_server_process, etcd, "resumed")
    with gemps.Client(target, name="w") as worker:
        worker.register({"w": np.zeros(PARAMETERS, np.float32)})
        worker.commit(np.ones(PARAMETERS, np.float32), kind="update")
        registration = worker.registration
    assert registration is not None
    stub = open_stub(primary.target)  # connected before the pause: asked at once on resuming
    before = replication_from_proto(stub.Status(pb.StatusRequest(), timeout=10))
    assert before is not None and before.role == PRIMARY and before.live == 2, before
    stop_process(primary.pid)
    try:
        wait_for(lambda: role_of(backup.target) == PRIMARY, 30, "the backup promoted", poll=0.02)
        etcd.pause()
        try:
            os.kill(primary.pid, signal.SIGCONT)
            resumed = replication_from_proto(stub.Status(pb.StatusRequest(), timeout=10))
            roles = scrape_series(f"http://127.0.0.1:{primary.metrics_port}/metrics")
            with pytest.raises(grpc.RpcError) as refused:
                stub.Commit(pb.CommitRequest(worker_id=registration.worker_id, base_version=1), timeout=10)
        finally:
            etcd.resume()
    finally:
        os.kill(primary.pid, signal.SIGCONT)
    assert resumed is not None and resumed.role == CANDIDATE, resumed
    assert resumed.backups == () and resumed.live == 0 and not resumed.under_replicated, resumed
    assert [value for series, value in roles.items() if _role_series(series, PRIMARY)] == [0.0], roles
    assert [value for series, value in roles.items() if _role_series(series, CANDIDATE)] == [1.0], roles
    assert reason_of(refused.value) == Reason.NOT_PRIMARY.value


def _role_series(series: str, role: str) -> bool:
    return series.startswith("gemps_replica_role{") and f'role="{role}"' in series
