"""A data-plane request the server takes in late is waited for; one it never acknowledges is not
(gemps.patient_writes).

Tens of workers at 100M parameters wait seconds for one of the server's upload buffers, the
server acknowledging their bytes but reading none. Linux counted that full window against the
socket's 5 s TCP_USER_TIMEOUT: the connection failed and the worker sent its payload again from
the start. A server gone mid-upload (its cable cut) must still be noticed within seconds, not
when the call's time is spent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gemps import Client, CommitResult, DeadlineExceededError, RetryPolicy, patient_writes
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import SimulatedNetwork
from tests.helpers import free_port, stop_process

# 64 MB of float32: more than the kernel's buffers of a socket take in at once (on loopback here up to
# 4 MB sent and 32 MB received: net.ipv4.tcp_wmem, tcp_rmem), so the write waits for the server.
SIZE = 16_000_000


def test_an_upload_the_server_takes_in_late_is_waited_for_not_sent_again(tmp_path: Path) -> None:
    """The server paused (SIGSTOP: its kernel acknowledges, it reads nothing) for longer than the
    5 s a socket allows unacknowledged bytes, while a commit is written: the attempt goes on and the
    commit is applied once, with no retry (before: the connection failed, and it was sent again)."""
    with ServerProcess(rule="downpour", port=free_port(), log_path=tmp_path / "server.log") as server:
        client = Client(server.target, plane="data", shared_memory=False, timeout=120, attempt_timeout=60)
        try:
            client.register({"w": np.zeros(SIZE, np.float32)})
            done: list[CommitResult] = []
            stop_process(server.pid)
            try:
                committing = threading.Thread(target=lambda: done.append(client.commit(np.ones(SIZE), kind="update")))
                committing.start()
                time.sleep(patient_writes.UNACKNOWLEDGED_MS / 1000 + 3)  # the scenario: a server busy this long
                assert not done
            finally:
                os.kill(server.pid, signal.SIGCONT)
            committing.join(60)
            assert done and done[0].version == 1
            assert client.retries == 0  # the one attempt, not a second one after a failed connection
            np.testing.assert_array_equal(client.pull().flat, np.ones(SIZE, np.float32))
        finally:
            client.close()


def one_attempt(
    network: SimulatedNetwork,
    tmp_path: Path,
    size: int,
    prepare: Callable[[ServerProcess], None],
    cut_after_s: float = 1.5,
) -> Any:
    """A server on host s, the probe on host w (100 Mbit/s each): the probe registers `size` values,
    `prepare(server)` sets the scene, the probe's one attempt at a commit starts, and `cut_after_s`
    later the server's cable is cut; how the attempt ended."""
    server_host, workers_host = network.add_host("s", rate="100mbit"), network.add_host("w", rate="100mbit")
    with ServerProcess(
        command=server_host.command(GEMPS_COMMAND), host=server_host.address, port=50051, data_port=51051,
        rule="downpour", log_path=tmp_path / "server.log",
    ) as server:  # fmt: skip
        argv = [sys.executable, "-m", "tests.upload_probe", f"{server_host.address}:50051", str(size)]
        probe = subprocess.Popen(workers_host.command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert probe.stdin is not None and probe.stdout is not None
        assert json.loads(probe.stdout.readline()) == {"registered": True}
        try:
            prepare(server)
            probe.stdin.write("go\n")
            probe.stdin.flush()
            time.sleep(cut_after_s)  # the scenario: the commit under way (or sent and awaiting its reply)
            network.cut(server_host)
            output, _ = probe.communicate(timeout=90)
        finally:
            os.kill(server.pid, signal.SIGCONT)
    return json.loads(output)


def test_a_server_gone_mid_upload_fails_the_attempt_within_seconds(network: SimulatedNetwork, tmp_path: Path) -> None:
    """The server's cable cut while a commit crosses a 100 Mbit/s link (64 MB: 5 s): its bytes go
    unacknowledged, and the attempt fails UNAVAILABLE within seconds of the 5 s, not at its 60 s."""
    outcome = one_attempt(network, tmp_path, SIZE, lambda server: None)
    assert "UNAVAILABLE: data plane of" in outcome["error"], outcome
    assert "acknowledged none of the request's bytes" in outcome["error"], outcome
    assert outcome["failed_after_s"] < 20, outcome  # its attempt's timeout is 60 s


def test_a_server_gone_while_its_reply_is_awaited_is_unavailable_not_a_deadline(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """A small commit sent to a paused server (its kernel takes it in), then the server's cable cut:
    the keepalives go unanswered, and the attempt fails within seconds as UNAVAILABLE, saying the
    connection timed out (before: DEADLINE_EXCEEDED "sent nothing within the timeout", its 60 s
    timeout far off)."""
    outcome = one_attempt(network, tmp_path, 1000, lambda server: stop_process(server.pid))
    assert "UNAVAILABLE: data plane of" in outcome["error"], outcome
    assert "the connection timed out" in outcome["error"], outcome
    assert outcome["failed_after_s"] < 20, outcome


def test_a_server_gone_while_its_full_window_holds_the_upload_fails_the_attempt_within_seconds(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """A 64 MB commit to a paused server: its kernel takes in what its buffers hold (36 MB: 3 s at
    100 Mbit/s), then offers a window of nothing, and the worker's kernel probes it. Then the
    server's cable is cut. Every byte sent was acknowledged, so only the probes go unanswered: the
    attempt fails UNAVAILABLE within seconds, not at its 60 s (before: the call's time spent)."""
    outcome = one_attempt(network, tmp_path, SIZE, lambda server: stop_process(server.pid), cut_after_s=6)
    assert "UNAVAILABLE: data plane of" in outcome["error"], outcome
    assert "answered none of the window probes" in outcome["error"], outcome
    assert outcome["failed_after_s"] < 25, outcome  # its attempt's timeout is 60 s


def test_an_upload_the_server_never_takes_in_within_the_calls_time_says_so(tmp_path: Path) -> None:
    """The server paused past the attempt's 3 s while a 64 MB commit is written: the attempt ends
    DEADLINE_EXCEEDED saying the server took in no more of the request (before: "sent nothing within
    the timeout", as if a reply were awaited), and the server, resumed, applied nothing."""
    with ServerProcess(rule="downpour", port=free_port(), log_path=tmp_path / "server.log") as server:
        client = Client(server.target, plane="data", shared_memory=False, timeout=3, retry=RetryPolicy(max_attempts=1))
        try:
            client.register({"w": np.zeros(SIZE, np.float32)})
            stop_process(server.pid)
            try:
                with pytest.raises(DeadlineExceededError) as failed:
                    client.commit(np.ones(SIZE), kind="update")
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert "took in no more of the request within the call's time" in str(failed.value), failed.value
            assert client.pull().version == 0
        finally:
            client.close()
