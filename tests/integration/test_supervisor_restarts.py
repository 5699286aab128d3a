"""The partitions' supervisor restarts every replica that died together (issue 61, item 3): it
restarted them one at a time, waiting for each to be ready and watching nothing meanwhile, so the
second of two killed replicas came back 2.5-6.7 s after the first; now both are started in the
same poll, and the etcd keeper and the other partitions are watched while they start."""

from __future__ import annotations

import os
import signal
from collections.abc import Collection
from pathlib import Path

from gemps_bench.procfs import children

from tests.helpers import wait_for
from tests.integration.conftest import StartServerProcess
from tests.integration.test_etcd_security import supervisor

#: the two restarts' start times may differ by at most this (the same poll: milliseconds apart)
TOGETHER_SECONDS = 0.5


def replica_processes(supervisor_pid: int) -> dict[int, int]:
    """The supervisor's replica processes: pid -> start time in clock ticks (etcd left out)."""
    found = {}
    for pid in children(supervisor_pid):
        try:
            if b"GEMPS_REPLICA_INDEX=" not in Path(f"/proc/{pid}/environ").read_bytes():
                continue
            found[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError):  # gone meanwhile
            continue
    return found


def test_two_replicas_killed_at_once_are_started_again_together(start_server_process: StartServerProcess) -> None:
    server, _etcd, _target = supervisor(start_server_process, "restart-together")

    def two(excluding: Collection[int] = ()) -> dict[int, int] | None:
        found = replica_processes(server.pid)
        return found if len(found) == 2 and not set(found) & set(excluding) else None

    before = wait_for(two, 60, "two replicas")
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    after = wait_for(lambda: two(excluding=before), 60, "both replicas started again")
    started = sorted(after.values())
    apart = (started[1] - started[0]) / os.sysconf("SC_CLK_TCK")
    assert apart <= TOGETHER_SECONDS, f"started {apart:.2f} s apart"
