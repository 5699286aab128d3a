"""An honest worker's commit rate beside a flood of TLS handshakes at the data port (issue 42,
item 4): --flooders threads of each --kinds (gemps_bench/tls_flood.py: "hello" ClientHellos closed
once answered, "hold" ClientHellos never finished, "full" handshakes then close, "dh" ClientHellos
that ask for the costliest key exchange, "connect" connections reset at once), from a process of
their own, from --source.

    .venv/bin/python scripts/tls_flood.py --parameters 100K --kinds hello,hold,full,dh --routes tcp,shared

One `gemps server` process per route with TLS on (--tls-cert/--tls-key, made here), defaults
otherwise. Per route, a worker (tcp: the data port under TLS; shared: the local socket and shared
memory), per kind: commits for --window seconds with no flood, then for --window seconds while
the flood goes on (after --warmup seconds of it), and a second worker registers meanwhile (which
plane it got says whether a newcomer from the flood's address still gets through). One JSON line
per phase: commits/s and p99 latency; during the flood also the ratio to the rate just before,
the flood's connections/s and the server's refusals by reason. Results:
docs/RELIABILITY.md ("Issue 42, item 4").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from gemps_bench.counts import parse_counts
from gemps_bench.honest_worker import commit_latencies
from gemps_bench.replica_security import replica_security
from gemps_bench.tls_flood import FloodProcess

import gemps
from gemps_worker.cluster import ServerProcess, free_port


def cpus(listed: str) -> set[int] | None:
    return {int(cpu) for cpu in listed.split(",")} if listed else None


def commits(client: gemps.Client, size: int, window: float) -> list[float]:
    """The latencies of the commits done in `window` seconds (a failed one is said, not counted:
    the data plane lost under TLS on 3673cc6)."""
    return commit_latencies(client, size, window, on_failure=_said)


def _said(error: gemps.GempsError) -> None:
    print(json.dumps({"commit_failed": error.message[:200]}), flush=True)


def refusals(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    prefix = 'gemps_data_plane_refusals_total{reason="'
    found = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line[len(prefix) :].split('"} ')
            if float(value):
                found[name] = float(value)
    return found


def one_route(route: str, args: argparse.Namespace, size: int, certificates: Any) -> None:
    options = {"tls_cert": str(certificates.cert), "tls_key": str(certificates.key), "data_port": free_port()}
    with ServerProcess(rule="downpour", log_level="warning", **options) as server:
        model = {"w": np.zeros(size, np.float32)}
        client_options: dict[str, Any] = {"ca_cert": str(certificates.ca), "shared_memory": route == "shared"}
        with gemps.Client(server.target, plane="data", timeout=60, **client_options) as worker:
            worker.register(model)
            commits(worker, size, args.warmup)

            def line(phase: str, latencies: list[float], **more: Any) -> None:
                fields = {"route": route, "phase": phase, "parameters": size, "flooders": args.flooders}
                p99 = round(float(np.percentile(np.array(latencies) * 1e3, 99)), 1) if latencies else None
                rate = {"commits_per_s": round(len(latencies) / args.window, 1), "p99_ms": p99}
                print(json.dumps({**fields, "source": args.source, **rate, **more}), flush=True)

            for kind in args.kinds.split(","):
                alone = commits(worker, size, args.window)  # the rate before, just before
                line(f"before {kind}", alone)
                started = time.monotonic()
                flood = FloodProcess(options["data_port"], kind, args.flooders, args.source, cpus(args.flood_cpus))
                with flood:
                    time.sleep(args.warmup)
                    before = refusals(server.metrics_port)
                    during = commits(worker, size, args.window)
                    try:
                        with gemps.Client(server.target, timeout=60, **client_options) as newcomer:
                            newcomer.register(model)
                            newcomer.commit(np.full(size, 1e-6, np.float32))
                            planes = newcomer.planes
                    except gemps.GempsError as error:  # (on 3673cc6, under "dh")
                        planes = [f"failed: {error.message[:100]}"]
                    after = refusals(server.metrics_port)
                    elapsed = time.monotonic() - started
                counted = {k: round(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}
                line(
                    f"flood: {kind}",
                    during,
                    ratio=round(len(during) / max(len(alone), 1), 2),
                    flood_per_s=round(flood.attempts / elapsed),
                    refusals=counted,
                    newcomer_planes=planes,
                )
                time.sleep(args.warmup)  # the flood's connections closed, its budget back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parameters", default="100K", help="P, e.g. 100K")
    parser.add_argument("--kinds", default="hello,hold,full,dh", help="the floods, measured in turn")
    parser.add_argument("--routes", default="tcp,shared", help="the honest worker's routes: tcp, shared")
    parser.add_argument("--flooders", type=int, default=2, help="flooding threads")
    parser.add_argument("--source", default="127.0.0.1", help="the flood's address (127.0.0.1: the workers')")
    parser.add_argument("--server-cpus", default="", help="CPUs of the server and the workers, e.g. 0 (all: empty)")
    parser.add_argument("--flood-cpus", default="", help="CPUs of the flood, e.g. 1 (as if it came from elsewhere)")
    parser.add_argument("--window", type=float, default=5.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measure")
    args = parser.parse_args()
    (size,) = parse_counts(args.parameters)
    if args.server_cpus:
        os.sched_setaffinity(0, cpus(args.server_cpus))  # the server process inherits it
    with tempfile.TemporaryDirectory(prefix="gemps-tls-flood-") as folder:
        certificates = replica_security(Path(folder), tls=True)
        for route in args.routes.split(","):
            one_route(route, args, size, certificates)


if __name__ == "__main__":
    main()
