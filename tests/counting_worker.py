"""A worker whose commits count themselves, for fault tests on simulated hosts.

Under `downpour`, an update of ones moves every value of θ by exactly 1, so once the run is over
each partition's θ (and its version) says how many commits it applied. This worker commits such
updates until a stop file appears or its budget is spent, and records for each partition how many
commits it acknowledged and how many ended in doubt (an error after which the commit may or may
not have been applied there), and the longest wait between two acknowledged commits (`gap`, wall
clock: when a fault began to show, and when training resumed) and every wait longer than
STALL_SECONDS (`stalls`). Exactly-once then reads, per partition:

    acknowledged <= applied <= acknowledged + in doubt

It also records which replica acknowledged its commits under each epoch of a replicated partition
(`acknowledgers`): never two under one epoch (`check_one_primary_per_epoch`).

    python -m tests.counting_worker --target 10.231.0.1:50051 --parameters 100000 --out w0.json \
        --stop-file stop [--commits 1000] [--timeout 5]

It writes `--out` (JSON) when it ends, and `--out` with ".ready" appended once it has
registered. With `--mark-file`, it also records the acknowledgements counted when that file
first appears (`acknowledged_at_mark`: the test creates it right after a fault, to tell the
commits a dead server acknowledged from those of its successor). `--observe` instead prints every
partition's version and θ's range once, as JSON.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import gemps

#: waits between two acknowledged commits longer than this are recorded (`stalls`), up to MAX_STALLS
STALL_SECONDS, MAX_STALLS = 0.2, 1000


def run(args: argparse.Namespace) -> dict[str, object]:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_file = Path(args.stop_file)
    # --timeout bounds each attempt; a call rides out a fault for up to a minute of retries
    client = gemps.Client(args.target, name=args.name, timeout=60.0, attempt_timeout=args.timeout, stop=stop)
    with client:
        client.register({"theta": np.zeros(args.parameters, np.float32)})
        Path(args.out + ".ready").write_text("registered\n")
        partitions = len(client.targets)
        acknowledged, in_doubt = [0] * partitions, [0] * partitions
        failures: list[str] = []
        last_ack, gap = time.time(), (0.0, 0.0)
        stalls: list[tuple[float, float]] = []
        at_mark: list[int] | None = None
        mark_file = Path(args.mark_file) if args.mark_file else None
        ones = np.ones(args.parameters, np.float32)
        # Per partition, which replica acknowledged commits under each epoch (one, if no split brain).
        acknowledgers: list[dict[int, set[str]]] = [{} for _ in range(partitions)]
        while len(failures) + acknowledged[0] < args.commits and not stop_file.exists() and not stop.is_set():
            try:
                committed = client.commit(ones, kind="update")
            except gemps.PartiallyAppliedError as partial:
                at_mark = at_mark or _marked(mark_file, acknowledged)
                failures.append(f"{type(partial).__name__}: {partial}")
                for index in partial.applied:
                    acknowledged[index] += 1
                for index in partial.refused:  # refused for sure only when the server said so
                    in_doubt[index] += int(partial.code is None or partial.reason == "")
            except gemps.GempsError as error:
                at_mark = at_mark or _marked(mark_file, acknowledged)
                failures.append(f"{type(error).__name__}: {error}")
                for index in range(partitions):
                    in_doubt[index] += 1
                if isinstance(error, gemps.StoppedError):
                    break
            else:
                at_mark = at_mark or _marked(mark_file, acknowledged)
                for index, (epoch, replica) in enumerate(zip(committed.epochs, client.targets, strict=True)):
                    acknowledged[index] += 1
                    acknowledgers[index].setdefault(epoch, set()).add(replica)
                now = time.time()
                if now - last_ack > gap[1] - gap[0]:
                    gap = (last_ack, now)
                if now - last_ack > STALL_SECONDS and len(stalls) < MAX_STALLS:
                    stalls.append((last_ack, now))
                last_ack = now
            if args.pause:
                time.sleep(args.pause)
        client.leave()
    by_epoch = [{str(epoch): sorted(replicas) for epoch, replicas in seen.items()} for seen in acknowledgers]
    record = {"acknowledged": acknowledged, "in_doubt": in_doubt, "failures": failures, "gap": gap, "stalls": stalls}
    record["acknowledgers"] = by_epoch
    return {**record, "acknowledged_at_mark": at_mark or _marked(mark_file, acknowledged)}


def _marked(mark_file: Path | None, acknowledged: list[int]) -> list[int] | None:
    """A copy of the counts when the mark file exists (checked once each commit has returned, before
    it is counted: a commit that returns after the fault was acknowledged by the successor)."""
    return list(acknowledged) if mark_file is not None and mark_file.exists() else None


def observe(target: str) -> dict[str, object]:
    with gemps.Client(target, timeout=30) as client:
        versions = [status.version for status in client.statuses()]
        theta = client.pull().flat
        return {"versions": versions, "theta_min": float(theta.min()), "theta_max": float(theta.max())}


def replication(target: str) -> dict[str, object]:
    """One replica's view of replication (its role, epoch and backups), asked of it alone."""
    with gemps.Client(target, timeout=5, retry=gemps.RetryPolicy(max_attempts=1)) as client:
        status = client.status()
    found = status.replication
    if found is None:
        return {"role": ""}
    backups = [{"name": b.name, "in_sync": b.in_sync, "lag_commits": b.lag_commits} for b in found.backups]
    return {"role": found.role, "epoch": found.epoch, "version": status.version, "backups": backups}


def check_exactly_once(records: list[dict[str, Any]], observed: dict[str, Any]) -> list[int]:
    """Per partition: acknowledged <= applied <= acknowledged + in doubt; returns the applied counts."""
    applied = [int(v) for v in observed["versions"]]
    for partition, count in enumerate(applied):
        acknowledged = sum(int(r["acknowledged"][partition]) for r in records)
        in_doubt = sum(int(r["in_doubt"][partition]) for r in records)
        assert acknowledged <= count, f"partition {partition} lost acknowledged commits: {count} < {acknowledged}"
        assert count <= acknowledged + in_doubt, (
            f"partition {partition} applied {count} commits; acknowledged {acknowledged}, in doubt {in_doubt}: "
            "some were applied twice"
        )
    assert observed["theta_min"] == min(applied) and observed["theta_max"] == max(applied)  # θ counts them
    return applied


def check_one_primary_per_epoch(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per partition, no two replicas acknowledged commits under the same epoch (no split brain),
    whichever worker saw them; returns partition 0's epochs and the replica of each."""
    partitions: list[dict[str, set[str]]] = [{} for _ in records[0]["acknowledgers"]]
    for record in records:
        for by_epoch, seen in zip(partitions, record["acknowledgers"], strict=True):
            for epoch, replicas in seen.items():
                by_epoch.setdefault(epoch, set()).update(replicas)
    for partition, by_epoch in enumerate(partitions):
        split = {epoch: sorted(replicas) for epoch, replicas in by_epoch.items() if len(replicas) > 1}
        assert not split, f"partition {partition}: two replicas acknowledged under one epoch: {split}"
    return {epoch: sorted(replicas) for epoch, replicas in partitions[0].items()}


def resumed_after(records: list[dict[str, Any]], fault: float, until: float | None = None) -> float:
    """Seconds from `fault` to the end of the longest wait that ended after it (before `until`, the
    next fault, when given), the worst worker's; fails when a worker has no such wait (it never
    resumed, or never saw the fault)."""
    ends: list[float] = []
    for record in records:
        stalls = [(float(start), float(end)) for start, end in record["stalls"]]
        after = [(end - start, end) for start, end in stalls if fault < end < (until or float("inf"))]
        assert after, f"a worker has no wait that ended after {fault} (it never resumed): {record['stalls']}"
        ends.append(max(after)[1])
    return max(ends) - fault


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--observe", action="store_true")
    parser.add_argument("--replication", action="store_true", help="print one replica's replication status")
    parser.add_argument("--name", default="counter")
    parser.add_argument("--parameters", type=int, default=100_000)
    parser.add_argument("--out", default="counting-worker.json")
    parser.add_argument("--stop-file", default="stop")
    parser.add_argument("--commits", type=int, default=10**9)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds each attempt of a call may take")
    parser.add_argument("--mark-file", default="", help="see the module's docstring")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between commits")
    args = parser.parse_args()
    if args.observe or args.replication:
        print(json.dumps(observe(args.target) if args.observe else replication(args.target)))
        return
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
