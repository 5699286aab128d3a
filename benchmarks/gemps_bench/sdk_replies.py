"""What an SDK worker's process pays a commit and its reply, on its own allocator.

`gemps bench`'s clients keep every large allocation in their heap (loadgen.py), the clients' best
case; a worker of the SDK keeps its process's allocator, so where its replies land in memory it
has not touched before it pays for each page too (docs/PERFORMANCE.md, "A reply into pages kept").
This measures that worker: one `gemps server` (DOWNPOUR, so the server's step is short), then one
client process at a time (`gemps.Client` over the data plane, TCP or shared memory) that commits a
gradient of SIZE float32s, two commits of warm-up (their replies land in new memory whatever the
SDK does) and COMMITS measured, holding each reply's θ until the next arrives, as a worker loading
it into its model does; with --partitions K, θ in K server processes, assembled by the client.
Printed: the client process's CPU milliseconds per measured commit (user and system, their median)
and its page faults per commit; and the run's wall time. The tree
measured is the one first on PYTHONPATH, so two trees alternated in a shell loop give a before and
after on the same host at the same time:

    .venv/bin/python -m gemps_bench.sdk_replies --size 124M --commits 6 --transport tcp
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from gemps.client import Client
from gemps_worker.cluster import ServerProcess

WARM_UP = 2  # commits not measured


def _usage() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, usage.ru_minflt


def client_run(target: str, size: int, commits: int, shared_memory: bool) -> dict[str, float]:
    """In the client's own process: the medians of each measured commit's CPU ms (its reply θ read
    and held) and page faults."""
    gradient = np.full(size, 1e-3, np.float32)
    user: list[float] = []
    system: list[float] = []
    faults: list[int] = []
    with Client(target, plane="data", shared_memory=shared_memory, timeout=600.0) as client:
        client.register({"w": np.zeros(size, np.float32)})
        held = None
        for commit in range(WARM_UP + commits):
            before = _usage()
            result = client.commit(gradient)
            held = result.parameters.flat  # a worker holds its θ until the next reply lands
            after = _usage()
            if commit >= WARM_UP:
                user.append((after[0] - before[0]) * 1e3)
                system.append((after[1] - before[1]) * 1e3)
                faults.append(after[2] - before[2])
        assert held is not None and held.size == size
    return {
        "client_cpu_ms_per_commit": statistics.median(u + s for u, s in zip(user, system, strict=True)),
        "client_user_ms_per_commit": statistics.median(user),
        "client_system_ms_per_commit": statistics.median(system),
        "page_faults_per_commit": statistics.median(faults),
    }


def measure(size: int, commits: int, transport: str, partitions: int = 1) -> dict[str, float | int | str]:
    """One server (of `partitions`), one client process (this module with --client): its figures and wall time."""
    with ServerProcess(rule="downpour", learning_rate=1e-3, metrics_port=-1, partitions=partitions) as server:
        start = time.monotonic()
        child = subprocess.run(
            [
                *(sys.executable, "-m", "gemps_bench.sdk_replies", "--client", server.target),
                *("--size", str(size), "--commits", str(commits), "--transport", transport),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.monotonic() - start
    if child.returncode != 0:
        raise RuntimeError(f"the client process failed ({child.returncode}): {child.stderr[-2000:]}")
    figures: dict[str, float | int | str] = json.loads(child.stdout)
    return figures | {
        "size": size, "commits": commits, "transport": transport, "partitions": partitions, "wall_seconds": wall,
    }  # fmt: skip


def _size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6}
    number = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"--size {text}: a positive count of parameters (e.g. 100M)")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=_size, default=_size("100M"), help="float32s in θ (default 100M)")
    parser.add_argument("--commits", type=int, default=6, help="commits measured after two of warm-up (default 6)")
    parser.add_argument("--transport", choices=("tcp", "shared"), default="tcp", help="the data plane's (default tcp)")
    parser.add_argument("--partitions", type=int, default=1, help="server processes θ is split across (default 1)")
    parser.add_argument("--client", metavar="TARGET", help=argparse.SUPPRESS)  # the client process's own run
    args = parser.parse_args(argv)
    if args.commits < 1:
        parser.error("--commits: at least 1")
    if args.partitions < 1:
        parser.error(f"--partitions {args.partitions}: at least 1")
    if args.client:
        print(json.dumps(client_run(args.client, args.size, args.commits, args.transport == "shared")))
    else:
        print(json.dumps(measure(args.size, args.commits, args.transport, args.partitions)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
