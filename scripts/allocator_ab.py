"""The server's allocator, A/B: one glibc arena (what `gemps server` runs with, allocator.one_arena)
against glibc's default of 8 arenas per core (MALLOC_ARENA_MAX in the server's environment, which
one_arena leaves alone), alternated in one run on the bench's load generator.

    .venv/bin/python scripts/allocator_ab.py --sizes 100K,1M,10M --clients 8 --reps 2

Prints one JSON line per run: commits/s, the server's peak RSS, p50 latency. Results:
docs/RELIABILITY.md ("Unbounded strings").
"""

from __future__ import annotations

import argparse
import json
import os

from gemps_bench.counts import parse_counts
from gemps_bench.gemps_load import GempsClientFactory
from gemps_bench.loadgen import LoadPlan, run_load

from gemps_worker.cluster import ServerProcess


def one_run(arenas: str, size: int, clients: int, window: float) -> dict[str, object]:
    if arenas == "default":
        os.environ["MALLOC_ARENA_MAX"] = str(8 * (os.cpu_count() or 1))
    try:
        server = ServerProcess(rule="gem", metrics_port=-1, log_level="warning").start()
    finally:
        os.environ.pop("MALLOC_ARENA_MAX", None)  # the load generator keeps glibc's defaults
    try:
        factory = GempsClientFactory(server.target, size, (("wire_dtype", "float32"),))
        summary = run_load("gemps", factory, LoadPlan(size, clients, window, 3.0), server.pid).summary()
    finally:
        server.close()
    return {
        "size": size,
        "clients": clients,
        "arenas": arenas,
        "commits_per_second": round(summary["commits_per_second"], 1),
        "server_peak_rss_mib": round(summary["server_peak_rss_bytes"] / 2**20),
        "latency_p50_ms": round(summary["latency_p50_ms"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100K,1M,10M", help="model sizes, e.g. 100K,1M")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2, help="runs of each side, alternated")
    parser.add_argument("--window", type=float, default=10.0, help="measured seconds per run")
    args = parser.parse_args()
    for size in parse_counts(args.sizes):
        for _rep in range(args.reps):
            for arenas in ("default", "one"):
                print(json.dumps(one_run(arenas, size, args.clients, args.window)), flush=True)


if __name__ == "__main__":
    main()
