"""A commit reaches every partition of θ at once, on the data plane over a socket too (gemps.fan_out).

Between hosts each partition has a link of its own, and a commit's slices must cross them side by
side: sent one after another, K partitions moved a commit no faster than one link. Here partition
0's process is paused (SIGSTOP: it reads nothing) while a commit larger than the sockets' buffers
is sent: partition 1 must get and apply its slice meanwhile, not after partition 0's is read (sent
one after the other, it got it only once partition 0's attempt had failed).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gemps_bench.procfs import partition_pids

from gemps import Client, CommitResult, patient_writes
from gemps.compression import Compressor
from gemps.held_copy import HeldCopy
from gemps_worker.cluster import ServerProcess
from tests.helpers import free_port, stop_process, wait_for

# 16M values a partition: 64 MB of float32, more than the kernel's buffers of a socket take in (on loopback
# here up to 4 MB sent and 32 MB received: net.ipv4.tcp_wmem, tcp_rmem).
SIZE = 32_000_000


def test_a_large_commit_reaches_the_other_partition_while_the_first_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A socket whose peer takes nothing in fails after UNACKNOWLEDGED_MS (5 s): the slices sent in
    # turn then reached partition 1 anyway, through partition 0's failed attempt and its retry.
    # Longer than the test here, so that only sending side by side gets partition 1 its slice.
    monkeypatch.setattr(patient_writes, "UNACKNOWLEDGED_MS", 600_000)
    options = {"partitions": 2, "rule": "downpour", "port": free_port(), "log_path": tmp_path / "server.log"}
    with ServerProcess(**options) as server:  # type: ignore[arg-type]
        client = Client(server.target, plane="data", shared_memory=False, timeout=120, attempt_timeout=120)
        second = Client(f"127.0.0.1:{server.port + 1}", timeout=30)  # partition 1, asked directly
        try:
            client.register({"w": np.zeros(SIZE, np.float32)})
            first = partition_pids(server.pid)[0]
            done: list[CommitResult] = []
            stop_process(first)
            try:
                committing = threading.Thread(
                    target=lambda: done.append(client.commit(np.ones(SIZE, np.float32), kind="update"))
                )
                committing.start()
                wait_for(lambda: second.status().version == 1, 60, "partition 1 applying its slice")
                assert not done  # partition 0 has not answered: it is still paused
            finally:
                os.kill(first, signal.SIGCONT)
            committing.join(120)
            assert done and done[0].version == 1
            np.testing.assert_array_equal(client.pull().flat, np.ones(SIZE, np.float32))  # downpour: θ += update
        finally:
            second.close()
            client.close()


def test_a_coded_commits_slices_are_coded_and_its_replies_read_each_on_a_thread_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At 85M parameters, int8 both ways and 4 partitions, coding the slices and reading the replies
    # into their copies was most of a worker's CPU a commit: one slice after another on one thread.
    where: dict[str, set[str]] = {"coded": set(), "read": set()}

    def recorded(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            where[kind].add(threading.current_thread().name)
            return method(*args)

        return run

    monkeypatch.setattr(Compressor, "encode", recorded("coded", Compressor.encode))
    monkeypatch.setattr(HeldCopy, "took", recorded("read", HeldCopy.took))
    size = 1_000_000  # 4 MB of float32: past fan_out.THREADED_BYTES
    options = {"partitions": 2, "rule": "downpour", "port": free_port(), "log_path": tmp_path / "server.log"}
    with ServerProcess(**options) as server:  # type: ignore[arg-type]
        client = Client(server.target, compression="int8", reply_compression="int8", timeout=60)
        try:
            client.register({"w": np.zeros(size, np.float32)})
            for version in (1, 2):  # a whole reply starts each copy, then a difference moves it
                assert client.commit(np.full(size, 0.5, np.float32), kind="update").version == version
            held = client.pull().flat
        finally:
            client.close()
    np.testing.assert_allclose(held, np.ones(size, np.float32), rtol=1e-2)  # downpour: θ += each update
    caller = threading.current_thread().name
    assert where == {"coded": {caller, "gemps-partition-call"}, "read": {caller, "gemps-partition-call"}}
