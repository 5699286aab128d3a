"""A worker whose commits count themselves, for fault tests on simulated hosts.

Under `downpour`, an update of ones moves every value of θ by exactly 1, so once the run is over
each partition's θ (and its version) says how many commits it applied. This worker commits such
updates until a stop file appears or its budget is spent, and records for each partition how many
commits it acknowledged and how many ended in doubt (an error after which the commit may or may
not have been applied there), and the longest wait between two acknowledged commits (`gap`, wall
clock: when a fault began to show, and when training resumed). Exactly-once then reads, per
partition:

    acknowledged <= applied <= acknowledged + in doubt

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


def run(args: argparse.Namespace) -> dict[str, object]:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_file = Path(args.stop_file)
    with gemps.Client(args.target, name=args.name, timeout=args.timeout, stop=stop) as client:
        client.register({"theta": np.zeros(args.parameters, np.float32)})
        Path(args.out + ".ready").write_text("registered\n")
        partitions = len(client.targets)
        acknowledged, in_doubt = [0] * partitions, [0] * partitions
        failures: list[str] = []
        last_ack, gap = time.time(), (0.0, 0.0)
        at_mark: list[int] | None = None
        mark_file = Path(args.mark_file) if args.mark_file else None
        ones = np.ones(args.parameters, np.float32)
        while len(failures) + acknowledged[0] < args.commits and not stop_file.exists() and not stop.is_set():
            try:
                client.commit(ones, kind="update")
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
                for index in range(partitions):
                    acknowledged[index] += 1
                now = time.time()
                if now - last_ack > gap[1] - gap[0]:
                    gap = (last_ack, now)
                last_ack = now
            if args.pause:
                time.sleep(args.pause)
        client.leave()
    record = {"acknowledged": acknowledged, "in_doubt": in_doubt, "failures": failures, "gap": gap}
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


def resumed_after(records: list[dict[str, Any]], healed: float) -> float:
    """Seconds from `healed` to the first commit acknowledged after the longest wait, the worst
    worker's; fails when a worker's longest wait did not span the fault (it never resumed)."""
    ends = [float(r["gap"][1]) for r in records]
    assert min(ends) > healed, f"a worker's longest wait ended before the cable healed: {ends} vs {healed}"
    return max(ends) - healed


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
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--mark-file", default="", help="see the module's docstring")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between commits")
    args = parser.parse_args()
    if args.observe or args.replication:
        print(json.dumps(observe(args.target) if args.observe else replication(args.target)))
        return
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
