"""The in-sync set's floor (--min-in-sync, issue 77; the Jepsen suite's seed 19) on real replica
processes and a real etcd: a primary whose only backup is out of reach acknowledges nothing it
alone holds, so killing it loses no acknowledged commit; with --min-in-sync 1 (two replicas'
default) it serves on (test_replicas.py, under-replicated). Three replicas' default is 2."""

from __future__ import annotations

import os
import signal

import gemps
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.status import PRIMARY, ReplicationStatus
from tests.helpers import stop_process, wait_for
from tests.integration.conftest import StartServerProcess
from tests.integration.test_replicas import counting, primary_and_backup, replication_of


def test_the_primary_alone_acknowledges_nothing_and_its_death_loses_no_acknowledged_commit(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """The backup is SIGSTOPped past --replica-timeout, then the primary is SIGKILLed and started
    again (a new incarnation, empty), then the backup resumed. Before the floor the backup was
    dropped, the primary acknowledged alone, and the replica elected afterwards lacked those
    commits; now the backup stays in the set, is promoted, and holds every acknowledged one."""
    primary, backup, target = primary_and_backup(start_server_process, etcd, "floor", min_in_sync=2)
    loops = counting(target, workers=3, timeout=30)
    loops.wait_each(10, 60, "10 commits per worker")
    wait_for(lambda: (s := replication_of(primary.target)) is not None and not s.under_replicated, 30, "in sync")
    stop_process(backup.pid)
    try:
        seen: list[ReplicationStatus] = []
        dropped_at: list[int] = []  # commits acknowledged when the primary was first seen alone

        def settled() -> bool:
            """Commits waiting on the kept backup, or (without the floor) acknowledged by the primary alone."""
            status = replication_of(primary.target)
            assert status is not None
            seen.append(status)
            if status.under_replicated and not dropped_at:
                dropped_at.append(sum(loops.acked))
            return bool(status.unavailable) or (bool(dropped_at) and sum(loops.acked) > dropped_at[0])

        wait_for(settled, 30, "the stopped backup past --replica-timeout", explain=lambda: repr(seen[-1:]))
        stalled = seen[-1]
        primary.kill()  # SIGKILL
        acknowledged = sum(loops.acked)
        start_server_process(**primary.options)  # a new incarnation of its name, holding nothing
    finally:
        os.kill(backup.pid, signal.SIGCONT)
    wait_for(lambda: (s := replication_of(backup.target)) is not None and s.role == PRIMARY, 60, "the backup promoted")
    loops.wait_each(5, 60, "5 more commits per worker, at the promoted backup")
    loops.stop()
    assert not loops.failures, loops.failures
    with gemps.Client(backup.target, timeout=5) as observer:
        version = observer.status().version
        theta = observer.pull().flat
    print(f"{acknowledged} acknowledged before the kill; {sum(loops.acked)} in all; the promoted backup at {version}")
    assert version >= acknowledged  # none lost
    assert theta.min() == theta.max() == version == sum(loops.acked)  # each applied once
    # kept in the set, and Status said why commits waited
    assert stalled is not None and [b.in_sync for b in stalled.backups] == [True], stalled
    assert "--min-in-sync 2" in stalled.unavailable, stalled
