"""`gemps worker --supervise on` against a real server: a killed worker is forked again from the
warm supervisor and commits again; SIGTERM to the supervisor ends both (issue 77, item 11)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gemps
from tests.helpers import InProcessServer, wait_for
from tests.integration.conftest import StartServer


def _children(pid: int) -> list[int]:
    """The processes `pid` forked that are alive (Linux's /proc children list)."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _first_commits(report: Path) -> int:
    """How many lives have committed: each life's report starts again at step 1."""
    if not report.exists():
        return 0
    return sum(1 for line in report.read_text().splitlines() if line.strip() and json.loads(line)["step"] == 1)


def _steps(report: Path) -> int:
    """How many steps the lives have reported (a line each)."""
    return len(report.read_text().splitlines()) if report.exists() else 0


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class Supervised:
    """`gemps worker --supervise on` whose first life was SIGKILLed and whose second has committed."""

    supervisor: subprocess.Popen[bytes]
    first: int  # the killed life's pid
    output: Path  # the supervisor's and its workers' log

    def explain(self) -> str:
        return self.output.read_text()


@contextlib.contextmanager
def first_life_killed(server: InProcessServer, tmp_path: Path, *flags: str) -> Iterator[Supervised]:
    report, output = tmp_path / "commits.jsonl", tmp_path / "worker.log"
    command = [
        sys.executable, "-m", "gemps_cli", "worker", "--supervise", "on", "--server", server.target,
        "--model", "mlp", "--epochs", "100000", "--report-file", str(report), "--log-every", "0", *flags,
    ]  # fmt: skip
    with output.open("w") as log:
        supervisor = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        explain = output.read_text
        # Three steps: two gaps between its commits, its pace (one killed sooner stands for the lease).
        wait_for(lambda: _steps(report) >= 3 or supervisor.poll() is not None, timeout=120, explain=explain)
        assert supervisor.poll() is None, explain()
        (first,) = _children(supervisor.pid)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: _first_commits(report) >= 2, timeout=120, what="the second worker's commit", explain=explain)
        yield Supervised(supervisor, first, output)
    finally:
        supervisor.kill()
        supervisor.wait()


def test_a_killed_worker_is_forked_again_and_commits_and_sigterm_ends_both(
    server: InProcessServer, tmp_path: Path
) -> None:
    with first_life_killed(server, tmp_path, "--name", "w") as run:
        (second,) = _children(run.supervisor.pid)
        assert second != run.first
        with gemps.Client(server.target) as observer:  # the new worker trains on: θ moves on its commits
            version = observer.status().version
            wait_for(lambda: observer.status().version > version, timeout=60, what="more commits", explain=run.explain)
        run.supervisor.send_signal(signal.SIGTERM)
        assert run.supervisor.wait(timeout=60) == 0, run.explain()  # the worker left cleanly: its exit code
    assert not _alive(second)
    logged = run.explain()
    assert f"restarting worker (pid {run.first} died with signal 9 (SIGKILL) after" in logged
    assert "passing SIGTERM on to worker" in logged and "stopped by signal" in logged
    assert "worker left" in server.log()  # the second life left cleanly, not evicted


def test_an_unnamed_supervised_workers_next_life_takes_the_dead_ones_place(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Without --name, every life of one supervisor is named after it (host and pid): a killed
    life's registration is superseded by the next one's in seconds, where an unnamed one held its
    slot and data shard for the lease (here longer than the test waits)."""
    server = start_server(lease_ttl=600)
    with first_life_killed(server, tmp_path) as run, gemps.Client(server.target) as observer:
        wait_for(
            lambda: observer.status().active_workers == 1,
            timeout=120,
            what="the dead life's registration forgotten",
            explain=server.log,
        )
        name = f"{socket.gethostname()}-{run.supervisor.pid}"
        assert f"supervised worker named {name}" in run.explain()
    evicted = [line for line in server.log().splitlines() if "worker evicted" in line]
    assert len(evicted) == 1 and f"name={name}" in evicted[0], evicted
    assert "superseded by a newer registration of its name" in evicted[0]
