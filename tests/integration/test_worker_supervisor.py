"""`gemps worker --supervise on` against a real server: a killed worker is forked again from the
warm supervisor and commits again; SIGTERM to the supervisor ends both (issue 77, item 11)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import gemps
from tests.helpers import InProcessServer, wait_for


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


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_worker_is_forked_again_and_commits_and_sigterm_ends_both(
    server: InProcessServer, tmp_path: Path
) -> None:
    report, output = tmp_path / "commits.jsonl", tmp_path / "worker.log"
    command = [
        sys.executable, "-m", "gemps_cli", "worker", "--supervise", "on", "--server", server.target,
        "--model", "mlp", "--epochs", "100000", "--name", "w", "--report-file", str(report), "--log-every", "0",
    ]  # fmt: skip
    with output.open("w") as log:
        supervisor = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        explain = output.read_text
        wait_for(lambda: _first_commits(report) >= 1 or supervisor.poll() is not None, timeout=120, explain=explain)
        assert supervisor.poll() is None, explain()
        (first,) = _children(supervisor.pid)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: _first_commits(report) >= 2, timeout=120, what="the second worker's commit", explain=explain)
        (second,) = _children(supervisor.pid)
        assert second != first
        with gemps.Client(server.target) as observer:  # the new worker trains on: θ moves on its commits
            version = observer.status().version
            wait_for(lambda: observer.status().version > version, timeout=60, what="more commits", explain=explain)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0, explain()  # the worker left cleanly: its exit code
    finally:
        supervisor.kill()
        supervisor.wait()
    assert not _alive(second)
    logged = output.read_text()
    assert f"restarting worker (pid {first} died with signal 9 (SIGKILL) after" in logged
    assert "passing SIGTERM on to worker" in logged and "stopped by signal" in logged
    assert "worker left" in server.log()  # the second life left cleanly, not evicted
