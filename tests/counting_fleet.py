"""Counting workers (tests/counting_worker.py) on one simulated host, as the fault tests drive
them: started, waited for until each registered, stopped through a stop file, read back with what
the servers applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemps_worker.simulated_hosts import Host
from tests.helpers import wait_for


@dataclass
class CountingFleet:
    """Counting workers on `host`, committing to `target`; their records and logs go to `folder`."""

    host: Host
    folder: Path
    target: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def mark_file(self) -> Path:
        """Created by a test right after a fault (see counting_worker's `--mark-file`)."""
        return self.folder / "mark"

    def start(
        self, count: int, *, parameters: int, timeout: float, env: Mapping[str, str] | None = None
    ) -> CountingFleet:
        """`count` workers of `parameters` float32 each, each call's deadline `timeout`; `env` adds
        to this process's environment (GEMPS_PLANE, say)."""
        for index in range(len(self.processes), len(self.processes) + count):
            argv = [sys.executable, "-m", "tests.counting_worker", "--target", self.target, "--name", f"w{index}",
                    "--parameters", str(parameters), "--out", str(self.record(index)),
                    "--stop-file", str(self.folder / "stop"), "--timeout", str(timeout),
                    "--mark-file", str(self.mark_file)]  # fmt: skip
            environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
            log_path = self.folder / f"w{index}.log"
            self.processes.append(self.host.start(argv, log_path=log_path, env=environment))
        return self

    def record(self, index: int) -> Path:
        return self.folder / f"w{index}.json"

    def wait_registered(self, timeout: float, explain: Callable[[], str]) -> None:
        wait_for(
            lambda: all(Path(f"{self.record(index)}.ready").exists() for index in range(len(self.processes))),
            timeout,
            "every worker registered",
            explain=explain,
        )

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Stop the workers; their records, and what the servers applied (asked from this host)."""
        (self.folder / "stop").write_text("stop\n")
        for process in self.processes:
            process.wait(120)
        records = [json.loads(self.record(index).read_text()) for index in range(len(self.processes))]
        observe = [sys.executable, "-m", "tests.counting_worker", "--observe", "--target", self.target]
        observed = subprocess.run(self.host.command(observe), capture_output=True, text=True, timeout=120)
        assert observed.returncode == 0, observed.stderr
        return records, json.loads(observed.stdout)
