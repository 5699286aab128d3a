"""What one reference worker (`gemps worker`) costs, against a bare `python -c 'import torch'`.

`docker compose up --scale worker=100` runs a hundred of them, so each must be little more than
torch itself. Both figures are ratios to the bare import measured in the same run, alternating
the two, because the machine is shared and absolute timings drift:

- rss_ratio: the worker's peak RSS over the bare import's (target <= 1.25);
- startup_ratio: wall time from spawning the worker to the server applying its first commit,
  over the bare import's wall time (target <= 2.0).

Run alone: `python -m gemps_bench.worker_cost [--repeats N] [--max-steps N]` prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

from gemps.client import Client
from gemps_worker.cluster import ServerProcess, worker_argv

RSS_TARGET = 1.25
STARTUP_TARGET = 2.0
POLL_INTERVAL = 0.01  # seconds between status polls while waiting for the first commit
FIRST_COMMIT_TIMEOUT = 120.0

Figures = dict[str, float | int | str]


@dataclass(frozen=True)
class ProcessSample:
    wall_s: float  # spawn to the event measured (exit, or first commit applied)
    peak_rss_bytes: int
    imported_s: float = math.nan  # bare import only: spawn to `import torch` done, before teardown

    def __str__(self) -> str:
        return f"{self.wall_s:.3f} s, peak RSS {self.peak_rss_bytes / 2**20:.1f} MB"


def _progress(message: str) -> None:
    print(f"worker_cost: {message}", file=sys.stderr, flush=True)


def _reap(process: subprocess.Popen[bytes]) -> tuple[int, int]:
    """Wait for the child; its exit code and peak RSS in bytes (ru_maxrss is in kB on Linux)."""
    _pid, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait on a reaped pid
    return process.returncode, usage.ru_maxrss * 1024


def _read(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


# The child also prints when the import is done (CLOCK_MONOTONIC is system-wide on Linux): the
# interpreter's teardown after `import torch` takes a few tenths of a second, which the wall time
# to exit includes and a worker's first commit does not.
_BARE_IMPORT = "import torch\nimport time\nprint(time.monotonic())"


def bare_import_sample() -> ProcessSample:
    """Wall time and peak RSS of `python -c 'import torch'`: the floor any worker pays."""
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", _BARE_IMPORT], stdout=subprocess.PIPE)
    code, rss = _reap(process)
    wall = time.monotonic() - start
    assert process.stdout is not None
    with process.stdout:
        printed = process.stdout.read()
    if code != 0:
        raise RuntimeError(f"bare `import torch` exited with {code}")
    return ProcessSample(wall, rss, float(printed) - start)


def default_worker(target: str, max_steps: int) -> list[str]:
    """`gemps worker` as users run it: the defaults (digits, digits-cnn, one thread), spelled out."""
    return worker_argv(target, dataset="digits", model="digits-cnn", threads=1, max_steps=max_steps)


def _wait_for_commit(client: Client, before: int, process: subprocess.Popen[bytes], started: float) -> float:
    """Seconds from `started` until the server has applied more than `before` commits."""
    while True:
        if client.status().commits_applied > before:
            return time.monotonic() - started
        if process.poll() is not None:
            raise RuntimeError(f"worker exited with {process.returncode} before its first commit")
        if time.monotonic() - started > FIRST_COMMIT_TIMEOUT:
            process.kill()
            raise TimeoutError(f"no commit within {FIRST_COMMIT_TIMEOUT}s of spawning the worker")
        time.sleep(POLL_INTERVAL)


def worker_sample(client: Client, max_steps: int) -> ProcessSample:
    """Spawn one reference worker; time its first applied commit, then its peak RSS once it exits."""
    before = client.status().commits_applied
    with tempfile.TemporaryFile() as log:
        started = time.monotonic()
        process = subprocess.Popen(default_worker(client.target, max_steps), stdout=log, stderr=subprocess.STDOUT)
        try:
            first_commit = _wait_for_commit(client, before, process, started)
        except (RuntimeError, TimeoutError) as error:
            _reap(process)
            raise RuntimeError(f"{error}; worker output:\n{_read(log)}") from None
        code, rss = _reap(process)
        if code != 0:
            raise RuntimeError(f"worker exited with {code}:\n{_read(log)}")
    return ProcessSample(first_commit, rss)


def _median(samples: list[ProcessSample], attribute: str) -> float:
    return float(statistics.median(getattr(s, attribute) for s in samples))


def _listed(values: Iterable[float]) -> str:
    """Raw samples, in the order taken, as one comma-separated string."""
    return ",".join(f"{v:.4g}" for v in values)


def summarize(bare: list[ProcessSample], workers: list[ProcessSample]) -> Figures:
    """Medians, the two ratios against their targets, and the raw samples."""
    bare_rss, worker_rss = _median(bare, "peak_rss_bytes"), _median(workers, "peak_rss_bytes")
    bare_wall, worker_wall = _median(bare, "wall_s"), _median(workers, "wall_s")
    bare_imported = _median(bare, "imported_s")
    rss_ratio, startup_ratio = worker_rss / bare_rss, worker_wall / bare_wall
    return {
        "repeats": len(workers),
        "bare_import_peak_rss_mb": bare_rss / 2**20,
        "bare_import_wall_s": bare_wall,
        "bare_import_until_imported_s": bare_imported,
        "worker_peak_rss_mb": worker_rss / 2**20,
        "worker_startup_to_first_commit_s": worker_wall,
        "rss_ratio": rss_ratio,
        "startup_ratio": startup_ratio,
        "startup_ratio_until_imported": worker_wall / bare_imported,  # stricter: no teardown in the bare figure
        "rss_target": RSS_TARGET,
        "startup_target": STARTUP_TARGET,
        "rss_target_met": rss_ratio <= RSS_TARGET,
        "startup_target_met": startup_ratio <= STARTUP_TARGET,
        "bare_import_wall_s_samples": _listed(s.wall_s for s in bare),
        "bare_import_until_imported_s_samples": _listed(s.imported_s for s in bare),
        "bare_import_peak_rss_mb_samples": _listed(s.peak_rss_bytes / 2**20 for s in bare),
        "worker_startup_s_samples": _listed(s.wall_s for s in workers),
        "worker_peak_rss_mb_samples": _listed(s.peak_rss_bytes / 2**20 for s in workers),
    }


def measure_worker_cost(repeats: int = 3, max_steps: int = 20) -> Figures:
    """Alternate bare imports and reference workers `repeats` times against one gem server."""
    bare: list[ProcessSample] = []
    workers: list[ProcessSample] = []
    with ServerProcess(rule="gem", metrics_port=-1) as server, Client(server.target, timeout=10.0) as client:
        for repeat in range(1, repeats + 1):
            bare.append(bare_import_sample())
            _progress(f"{repeat}/{repeats} bare import to exit: {bare[-1]}")
            workers.append(worker_sample(client, max_steps))
            _progress(f"{repeat}/{repeats} worker to first commit: {workers[-1]}")
    return summarize(bare, workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="bare imports and workers, alternated")
    parser.add_argument("--max-steps", type=int, default=20, help="commits each worker makes before leaving")
    args = parser.parse_args(argv)
    print(json.dumps(measure_worker_cost(args.repeats, args.max_steps), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
