"""Starting a child process that says it is ready by writing a port file, and waiting for it.

The child (`gemps server --port-file`, the benchmarks' echo server) writes its ports, one number
per line, and renames the file into place last, so a reader never sees a partial file. Used by
the local-cluster harness (gemps_worker.cluster) and by the partitions of `gemps server
--partitions K` (gemps_cli.partitions), which starts several before it waits for any. Nothing here
imports more than the standard library: `gemps server` uses it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: how this interpreter runs a `gemps` command (works without the console script on PATH)
GEMPS_COMMAND = (sys.executable, "-m", "gemps_cli")


class ChildExitedError(RuntimeError):
    """The child exited before it wrote its port file."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited with {returncode} before writing its port file")
        self.returncode = returncode


def launch(
    command: Sequence[str],
    port_file: Path,
    *,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `command` (its output appended to `log_path`, else this process's; `env`: its whole
    environment, else this process's), first removing the port file of an earlier start, which
    would read as ready."""
    port_file.unlink(missing_ok=True)
    if log_path is None:
        return subprocess.Popen(list(command), env=env)
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for_port_file(
    process: subprocess.Popen[bytes], port_file: Path, *, timeout: float, poll_seconds: float
) -> list[int]:
    """The numbers in `port_file` once `process` has written it.

    Raises ChildExitedError if the process exits first, TimeoutError after `timeout` seconds; a
    child that is late is left running (the caller decides whether to stop it).
    """
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None:
            raise ChildExitedError(process.returncode)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port file after {timeout}s")
        time.sleep(poll_seconds)
    return [int(line) for line in port_file.read_text().split()]
