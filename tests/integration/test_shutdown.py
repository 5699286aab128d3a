"""Shutdown against real server processes (issue 15, items 4, 5 and 11b; issue 28, item 4):
SIGTERM right after a burst of commits with a checkpoint per commit never hangs and loses
nothing; a final checkpoint that cannot be written ends the process with a non-zero status naming
the versions lost; an open Health.Watch stream does not hold shutdown, nor one whose client never
reads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gemps
from gemps_server.app import EXIT_CHECKPOINT_LOST
from gemps_server.checkpoint_files import list_checkpoints, load
from gemps_worker.cluster import ServerProcess
from tests.helpers import wait_for
from tests.integration.conftest import StartServer
from tests.raw_http2 import RawConnection, grpc_frame

PARAMS = {"w": np.zeros(64, np.float32)}
WORKERS = 4
ROUNDS = 6  # the hang this guards against came in about half the runs
QUIET = ("--port", "0", "--data-port", "0", "--metrics-port", "-1")
FEW_RETRIES = gemps.RetryPolicy(max_attempts=2, initial_backoff=0.05, max_backoff=0.1)
#: a grace a held shutdown would spend whole; half of it bounds a prompt one on a loaded host (a
#: stop under two busy test workers took over 5 s where it takes under 1 alone)
GRACE = 60.0


def committing(target: str, acknowledged: list[int], stop: threading.Event) -> None:
    """Commit until the server goes away (or `stop`), recording every version acknowledged."""
    try:
        with gemps.Client(target, retry=FEW_RETRIES, timeout=10) as client:
            client.register(PARAMS)
            while not stop.is_set():
                acknowledged.append(client.commit(np.ones(64, np.float32)).version)
    except gemps.GempsError:
        pass  # the server shut down under us: expected


def test_sigterm_in_a_burst_stops_promptly_with_every_acknowledged_commit_checkpointed(tmp_path: Path) -> None:
    for round_ in range(ROUNDS):
        directory = tmp_path / f"round-{round_}"
        server = ServerProcess(checkpoint_dir=directory, checkpoint_every=1, checkpoint_interval=0, shutdown_grace=2)
        acknowledged: list[int] = []
        stop = threading.Event()
        with server:
            threads = [
                threading.Thread(target=committing, args=(server.target, acknowledged, stop)) for _ in range(WORKERS)
            ]
            for thread in threads:
                thread.start()
            wait_for(lambda seen=acknowledged: len(seen) >= 50, what="a burst of commits")  # type: ignore[misc]
            code = server.stop(timeout=30)  # SIGTERM while commits arrive; SIGKILL only if it hangs
            stop.set()
            for thread in threads:
                thread.join(30)
            assert code == 0, f"round {round_}: exit {code}\n{server.log()[-3000:]}"
        newest = load(list_checkpoints(directory)[-1][1])
        assert newest.version >= max(acknowledged), f"round {round_}: an acknowledged commit is not in the checkpoint"


def test_a_final_checkpoint_that_cannot_be_written_exits_non_zero_naming_the_lost_versions(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    server = ServerProcess(checkpoint_dir=directory, checkpoint_every=0, checkpoint_interval=0)
    with server:
        with gemps.Client(server.target) as client:
            client.register(PARAMS)
            for _ in range(3):
                client.commit(np.ones(64, np.float32))
        directory.rename(tmp_path / "moved")  # the disk under the server goes away ...
        directory.write_text("not a directory")  # ... and something else is in its place
        assert server.stop(timeout=30) == EXIT_CHECKPOINT_LOST
        log = server.log()
    assert "checkpoint failed" in log
    assert "stopped without a final checkpoint version=3 newest_checkpoint=- lost=1..3" in log


def test_an_open_health_watch_does_not_hold_shutdown_for_the_grace_period(start_server: StartServer) -> None:
    """A Watch stream is told NOT_SERVING and ended: shutdown waits for real work, not for it."""
    server = start_server()
    channel = grpc.insecure_channel(server.target)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
    statuses = [next(watch).status]  # SERVING: the stream is open
    grace = GRACE
    started = time.monotonic()
    server.stop(grace=grace)
    took = time.monotonic() - started
    statuses += [reply.status for reply in watch]  # ends (status OK) instead of being cancelled
    channel.close()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses == [serving, not_serving]
    assert took < grace / 2, f"shutdown took {took:.1f} s of a {grace:g} s grace period"


def test_a_watch_whose_client_never_reads_does_not_hold_shutdown() -> None:
    """Issue 28, item 4: a Watch on a connection whose receive window is zero. The server's write
    of its first status never completes, and a graceful stop waited the whole grace for the
    stream (20.2 s of a 20-s grace). Now, once no call carrying work is left, Watch streams get a
    moment to take NOT_SERVING and the rest are cancelled; reading watchers still end cleanly."""
    grace = GRACE
    server = ServerProcess(shutdown_grace=grace)
    with server:
        unread = RawConnection(server.port, receive_window=0)
        request = grpc_frame(health_pb2.HealthCheckRequest(service="").SerializeToString())
        stream = unread.open("/grpc.health.v1.Health/Watch", request)
        unread.until(lambda: stream in unread.answered, 30, "the Watch's handler replying")
        channel = grpc.insecure_channel(server.target)
        reader = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        statuses = [next(reader).status]
        started = time.monotonic()
        code = server.stop(timeout=2 * grace)
        took = time.monotonic() - started
        statuses += [reply.status for reply in reader]  # the reading watcher still ends cleanly
        channel.close()
        unread.close()
        assert code == 0, server.log()[-3000:]
    assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert took < grace / 2, f"shutdown took {took:.1f} s of a {grace:g} s grace period"


def test_a_sigterm_the_moment_the_port_file_appears_is_a_graceful_stop(tmp_path: Path) -> None:
    """A supervisor may stop a server as soon as its port file says it serves. The handlers used to
    be installed after that, so SIGTERM there killed the process (-15) before it logged its
    configuration (CI saw the `configuration` line missing) and without a graceful stop."""
    port_file = tmp_path / "server.port"
    process = subprocess.Popen(
        [sys.executable, "-m", "gemps_cli", "server", *QUIET, "--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not port_file.exists() and process.poll() is None and time.monotonic() < deadline:
        pass  # a busy wait: the signal must follow the file as closely as a process can
    process.terminate()
    output = process.communicate(timeout=60)[0].decode()
    assert process.returncode == 0, output
    assert "configuration" in output and "stopped" in output, output
