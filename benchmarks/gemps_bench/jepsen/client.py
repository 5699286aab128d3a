"""A counting worker that keeps a history: every acknowledgement with the epoch and the replica
that gave it, for the Jepsen suite's checker (gemps_bench.jepsen.check).

Under `downpour` an update of ones moves every value of θ by exactly 1, so a partition's θ (and
its version) counts the commits it applied, as tests/counting_worker.py does for the fault tests.
This one (one partition) records its acknowledgements as runs of one (epoch, replica): [epoch,
replica, first, last, count] in the order seen, so the checker can tell an epoch held by two
replicas, an epoch seen again after a newer one, and when the worker last heard an acknowledgement;
every wait between two acknowledgements longer than STALL_SECONDS; and every commit that ended in
an error, counted in doubt (it may or may not have been applied: a refusal may answer the retry of
an attempt that was applied). While it runs, `--out`.ack holds the time of its last acknowledgement
(rewritten at most every ACK_FILE_SECONDS), so that the trial can tell when every worker goes on.

    python -m gemps_bench.jepsen.client --target A|B --name w0 --out w0.json --stop-file stop
    python -m gemps_bench.jepsen.client --target A|B --observe   # the primary's version and θ's range

It writes `--out` when it ends (the stop file appears, or SIGTERM), and `--out`.ready once registered.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import gemps

STALL_SECONDS, MAX_STALLS, MAX_SAMPLES, ACK_FILE_SECONDS = 0.2, 2000, 20, 0.5


@dataclass
class History:
    """What one worker was told, compacted (see the module's docstring)."""

    started: float
    acknowledged: int = 0
    in_doubt: int = 0
    runs: list[list[Any]] = field(default_factory=list)  # [epoch, replica, first, last, count]
    stalls: list[list[float]] = field(default_factory=list)  # [last acknowledgement, next one]
    errors: dict[str, int] = field(default_factory=dict)  # by type
    samples: list[list[Any]] = field(default_factory=list)  # [time, message], the first few
    last_ack: float = 0.0
    ended: float = 0.0

    def acknowledge(self, now: float, epoch: int, replica: str) -> None:
        self.acknowledged += 1
        previous = self.last_ack or self.started
        if now - previous > STALL_SECONDS and len(self.stalls) < MAX_STALLS:
            self.stalls.append([previous, now])
        self.last_ack = now
        if self.runs and self.runs[-1][:2] == [epoch, replica]:
            self.runs[-1][3], self.runs[-1][4] = now, self.runs[-1][4] + 1
        else:
            self.runs.append([epoch, replica, now, now, 1])

    def fail(self, now: float, error: Exception) -> None:
        self.in_doubt += 1
        name = type(error).__name__
        self.errors[name] = self.errors.get(name, 0) + 1
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append([now, f"{name}: {error}"[:300]])


def run(args: argparse.Namespace) -> History:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_file = Path(args.stop_file)
    with gemps.Client(
        args.target, name=args.name, timeout=args.call_timeout, attempt_timeout=args.timeout, stop=stop, job=args.job
    ) as client:
        client.register({"theta": np.zeros(args.parameters, np.float32)})
        history = History(started=time.time())
        Path(args.out + ".ready").write_text("registered\n")
        ones = np.ones(args.parameters, np.float32)
        ack_file, written = Path(args.out + ".ack"), 0.0
        while not stop_file.exists() and not stop.is_set():
            try:
                committed = client.commit(ones, kind="update")
            except gemps.GempsError as error:  # any error: the commit may have been applied
                history.fail(time.time(), error)
                if isinstance(error, gemps.StoppedError):
                    break
            else:
                history.acknowledge(time.time(), committed.epochs[0], client.targets[0])
                if history.last_ack - written > ACK_FILE_SECONDS:
                    ack_file.write_text(repr(history.last_ack))
                    written = history.last_ack
        history.ended = time.time()
    return history  # no leave(): the partition may have no primary now; the lease expires it


def observe(target: str) -> dict[str, Any]:
    """The primary's version and θ's range (a commit moved every value by 1)."""
    with gemps.Client(target, timeout=10, retry=gemps.RetryPolicy(max_attempts=3)) as client:
        version = client.status().version
        theta = client.pull().flat
        return {"version": version, "theta_min": float(theta.min()), "theta_max": float(theta.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--target", required=True, help="every replica of the partition, A|B")
    parser.add_argument("--observe", action="store_true", help="print the primary's version and θ's range")
    parser.add_argument("--name", default="counter")
    parser.add_argument("--job", default="", help="the job it trains (gemps.Client's job; default: none named)")
    parser.add_argument("--parameters", type=int, default=20_000)
    parser.add_argument("--out", default="worker.json")
    parser.add_argument("--stop-file", default="stop")
    parser.add_argument("--timeout", type=float, default=10.0, help="each attempt's deadline, seconds")
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=120.0,
        help="each call's deadline, retries through faults included, seconds",
    )
    args = parser.parse_args()
    if args.observe:
        print(json.dumps(observe(args.target)))
        return
    Path(args.out).write_text(json.dumps(asdict(run(args))))


if __name__ == "__main__":
    main()
