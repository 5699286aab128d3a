"""GEM's per-worker state, exact against compact, measured on real servers in one run (issue 45):
what a worker costs the server's memory, and what a commit costs its applier.

    python -m gemps_bench.gem_state --parameters 10M --workers 16 --out docs/results/gem_state/memory-10m.json

For each `--gem-state`, in turn and `--rounds` times alternating (the machine is shared: ratios
are taken within a round): a `gemps server` process; one worker registers theta and commits a few
times (so the rule has made every buffer it keeps whatever the number of workers: compact's two
references); its private resident memory (RssAnon: the workers here reach the data plane over TCP,
so no memory of theirs is mapped into the server) is read; then the other workers register and
commit, and it is read again. Growth per worker per parameter = (after - before) / ((W - 1) x P).
Then every worker commits `--commits` times, one at a time in turn: the CPU time of the applier's
operations (gemps_applier_cpu_seconds: its thread's, so the machine's load does not count) and the
server process's CPU seconds per commit. Payloads are random
gradients; one process drives every worker, one commit at a time, so the figures are the server's.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import gemps
from gemps_bench.counts import parse_counts
from gemps_bench.procfs import cpu_seconds, private_rss
from gemps_worker.cluster import ServerProcess

STATES = ("exact", "compact")
WARM_COMMITS = 4  # the first worker's: past compact's first refresh (2 commits with one worker)
# gRPC: a data-plane connection keeps pooled buffers of its own, which would count as per-worker growth
PLANE = "grpc"


@dataclass(frozen=True)
class Measured:
    state: str
    round: int
    parameters: int
    workers: int
    rss_one_worker_bytes: int
    rss_all_workers_bytes: int
    growth_bytes_per_worker_parameter: float
    reported_worker_state_bytes: int  # Status: one worker's rule state
    reported_shared_state_bytes: int  # Status: what the rule keeps for the workers together
    registered_workers: int  # Status: workers registered when the second figure was read
    commits: int
    applier_ms_per_commit: float
    server_cpu_ms_per_commit: float


def settled_rss(pid: int) -> int:
    """RssAnon once the server's allocator has given back what the last operations freed."""
    time.sleep(1.0)
    found = private_rss(pid)
    if found is None:
        raise RuntimeError(f"the server (process {pid}) has exited")
    return found


def applier_seconds(server: ServerProcess) -> float:
    """The CPU time the applier's operations took so far (gemps_applier_cpu_seconds_total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gemps_applier_cpu_seconds_total":
                return float(sample.value)
    raise RuntimeError("the server's /metrics has no gemps_applier_cpu_seconds_total")


def measure(state: str, round_index: int, parameters: int, workers: int, commits: int) -> Measured:
    rng = np.random.default_rng(round_index)
    theta = rng.standard_normal(parameters).astype(np.float32)
    gradients = [rng.standard_normal(parameters).astype(np.float32) for _ in range(2)]
    most = max(parameters, 1 << 20)
    with ServerProcess(
        rule="gem", gem_state=state, lease_ttl=3600.0, log_level="warning", max_parameters=most, max_workers=workers + 1
    ) as server:
        first = gemps.Client(server.target, name="w0", plane=PLANE, timeout=600)
        clients = [first]
        try:
            first.register({"theta": theta})
            for step in range(WARM_COMMITS):
                first.commit(gradients[step % 2])
            before = settled_rss(server.pid)
            for index in range(1, workers):
                client = gemps.Client(server.target, name=f"w{index}", plane=PLANE, timeout=600)
                client.register({"theta": theta})
                client.commit(gradients[0])
                # A client keeps the newest theta it received: with no commits to time, one that has
                # registered and committed is let go (not closed: its registration and GEM state stay
                # for the lease, an hour), so the bench's own memory stays one theta, whatever W.
                if commits:
                    clients.append(client)
            after = settled_rss(server.pid)
            status = first.status()
            busy, cpu = applier_seconds(server), cpu_seconds(server.pid) or 0.0
            for step in range(commits):
                for client in clients:
                    client.commit(gradients[step % 2])
            busy, cpu = applier_seconds(server) - busy, (cpu_seconds(server.pid) or 0.0) - cpu
        finally:
            for client in clients:
                client.close()
    count = commits * workers
    return Measured(
        state=state,
        round=round_index,
        parameters=parameters,
        workers=workers,
        rss_one_worker_bytes=before,
        rss_all_workers_bytes=after,
        growth_bytes_per_worker_parameter=(after - before) / ((workers - 1) * parameters),
        reported_worker_state_bytes=status.worker_state_bytes,
        reported_shared_state_bytes=status.shared_rule_state_bytes,
        registered_workers=status.active_workers,
        commits=count,
        applier_ms_per_commit=1e3 * busy / count if count else math.nan,
        server_cpu_ms_per_commit=1e3 * cpu / count if count else math.nan,
    )


def describe(found: Measured) -> str:
    mib = 2**20
    return (
        f"round {found.round} {found.state:8s} P={found.parameters:,} W={found.workers} "
        f"({found.registered_workers} registered): "
        f"{found.growth_bytes_per_worker_parameter:.2f} bytes per worker per parameter "
        f"(RssAnon {found.rss_one_worker_bytes / mib:,.0f} -> {found.rss_all_workers_bytes / mib:,.0f} MiB; "
        f"Status says {found.reported_worker_state_bytes / found.parameters:.2f} per worker + "
        f"{found.reported_shared_state_bytes / mib:,.0f} MiB shared), applier CPU "
        f"{found.applier_ms_per_commit:.2f} ms/commit, server CPU {found.server_cpu_ms_per_commit:.2f} ms/commit"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--parameters", default="10M", help="model size P (10M, 1M, 250K, ...)")
    parser.add_argument("--workers", type=int, default=16, help="registered workers (the first is the baseline)")
    parser.add_argument(
        "--commits", type=int, default=4, help="commits per worker timed for the cost (0: memory alone, W of any size)"
    )
    parser.add_argument(
        "--states", default=",".join(STATES), help=f"which --gem-state to measure ({', '.join(STATES)})"
    )
    parser.add_argument("--rounds", type=int, default=1, help="measurements of each state, alternating")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers: at least 2 (the first one is the baseline the others are measured against)")
    states = args.states.split(",")
    if unknown := sorted(set(states) - set(STATES)):
        parser.error(f"--states: unknown {', '.join(unknown)} (choose from {', '.join(STATES)})")
    (parameters,) = parse_counts(args.parameters)
    results = []
    for round_index in range(args.rounds):
        for state in states:
            found = measure(state, round_index, parameters, args.workers, args.commits)
            results.append(found)
            print(describe(found), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": [asdict(result) for result in results]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
