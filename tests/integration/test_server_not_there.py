"""A new user's first hour (issue 60, item 1): a worker whose server is not there says so at
WARNING, naming the address, within seconds (a plain script shows WARNINGs only; the retries'
INFO lines stayed hidden for the whole patience), and `gemps export` of a server that is down
fails at once, as `gemps status` does."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

from tests.helpers import free_port

# A plain script, as a user writes one: no logging configured, so only WARNINGs and above show.
WORKER = """
import sys, torch
from gemps.pytorch import RemoteOptimizer
print("binding", file=sys.stderr, flush=True)
RemoteOptimizer(torch.nn.Linear(2, 1), sys.argv[1])
"""


def stderr_lines(process: subprocess.Popen[str]) -> queue.Queue[tuple[float, str]]:
    """Each line `process` writes to stderr, with when it came."""
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_worker_without_its_server_warns_naming_the_address_within_5_s() -> None:
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-c", WORKER, address],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GEMPS_PATIENCE": "30"},
    )
    try:
        lines = stderr_lines(process)
        seen: list[str] = []
        while not seen or seen[-1].strip() != "binding":  # torch imported: the worker binds now
            seen.append(lines.get(timeout=120)[1])
        started = time.monotonic()
        said = None
        while said is None and time.monotonic() < started + 10:
            try:
                at, line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            said = (at, line) if address in line else None
        assert said is not None, f"nothing named {address} within 10 s: {seen}"
        at, line = said
        assert at - started < 5.0, seen
        assert "has not answered" in line and "patience" in line and "GEMPS_PATIENCE" in line, line
    finally:
        process.kill()
        process.wait()


def test_export_of_a_server_that_is_down_fails_as_fast_as_status() -> None:
    address = f"127.0.0.1:{free_port()}"
    timings = {}
    for command in (["status", "--server", address], ["export", "--server", address, "--out", os.devnull]):
        began = time.monotonic()
        completed = subprocess.run(
            [sys.executable, "-m", "gemps_cli", *command], capture_output=True, text=True, timeout=60
        )
        timings[command[0]] = time.monotonic() - began
        assert completed.returncode == 1, completed.stderr
        assert address in completed.stderr, completed.stderr
    assert timings["export"] < timings["status"] + 3.0, timings  # not its 30 s --timeout
