"""What every peer's worker program shares: the contract's set-up (flags, workload, this rank's
batches, the local optimizer), the deadline, SIGTERM, and a failure written into the run's output.

A peer module gives `run_program` its coordinator and its worker; `run_program` parses the flags,
runs the role asked for until the deadline, and turns an exception into DIR/worker-R.error or
DIR/coordinator.error (the traceback, appended: a restarted rank keeps its earlier failures) and a
non-zero exit, so a scenario a peer cannot run shows its error in the run's output.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
from torch import nn

from gemps_bench.alternatives.contract import (
    ProgressLog,
    Snapshots,
    WorkerArgs,
    local_optimizer,
    parse_worker_args,
    worker_parser,
)
from gemps_bench.alternatives.workloads import Workload, workload

#: seconds past the deadline after which a worker still inside a step exits anyway
EXIT_GRACE_S = 10.0


def process_age_s() -> float:
    """Seconds since this process started (the deadline counts from there: importing torch at a fifth
    of a core takes seconds, and they count)."""
    after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started_s = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - started_s


@dataclass
class PeerWorker:
    """One worker of a peer: its flags, workload, model (θ0 of the workload) and this rank's batches."""

    args: WorkerArgs
    workload: Workload
    model: nn.Module
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    #: the snapshot writer on the rank whose model stands for the shared one, else None
    snapshots: Snapshots | None
    deadline_monotonic: float

    def start(self) -> ProgressLog:
        """Once set up: the progress log (its "start" line), the harness's start gate, then a watchdog
        that ends the process EXIT_GRACE_S after the deadline should a step still hold it (a quorum or
        an averaging round waiting on peers that have gone): the contract's exit at the deadline."""
        log = ProgressLog(self.args.run_dir, self.args.rank)
        log.wait_for_go(self.args.run_dir)
        watchdog = threading.Timer(self.seconds_left() + EXIT_GRACE_S, _overdue, (log,))
        watchdog.daemon = True
        watchdog.start()
        return log

    def time_left(self) -> bool:
        return time.monotonic() < self.deadline_monotonic

    def seconds_left(self) -> float:
        return max(0.0, self.deadline_monotonic - time.monotonic())

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The manifest entry's `--optimizer` at `--lr`: the contract's SGD with momentum 0.9, or
        nanoGPT's AdamW (contract.local_optimizer)."""
        return local_optimizer(self.args.optimizer, self.model, self.args.lr)

    def snapshot(self, model: nn.Module | None = None) -> None:
        """A snapshot of the shared model as this worker holds it now (rate-limited by Snapshots)."""
        if self.snapshots is not None:
            self.snapshots.write(self.model if model is None else model)


def _overdue(log: ProgressLog) -> None:
    print(f"past the deadline by {EXIT_GRACE_S} s inside a step: exiting", file=sys.stderr, flush=True)
    log.event("exit")
    os._exit(0)


def deadline_monotonic(args: WorkerArgs) -> float:
    return time.monotonic() + args.deadline_s - process_age_s()


def prepare_worker(args: WorkerArgs, snapshot_rank: int = 0) -> PeerWorker:
    """The worker's workload at `--batch`, its model, its shard's batches and its snapshot writer
    (the progress log comes once the peer is set up: `PeerWorker.start`)."""
    torch.set_num_threads(1)  # each worker has a fraction of one core (CONTRACT.md)
    chosen = workload(args.workload)
    if args.batch != chosen.batch:
        chosen = dataclasses.replace(chosen, batch=args.batch)
    return PeerWorker(
        args=args,
        workload=chosen,
        model=chosen.build_model(seed=0),
        batches=chosen.batches(args.rank, args.world, args.seed),
        snapshots=Snapshots(args.run_dir, args.snapshot_every) if args.rank == snapshot_rank else None,
        deadline_monotonic=deadline_monotonic(args),
    )


def coordinator_endpoint(args: WorkerArgs) -> tuple[str, int]:
    """`--coordinator HOST:PORT` split (a bracketed IPv6 host unbracketed); a clear error when absent."""
    host, separator, port = args.coordinator.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    return host.strip("[]"), int(port)


def own_address(coordinator_host: str) -> str:
    """This worker's address as the coordinator sees it: the source address of the route to the
    coordinator (loopback on one host; the worker's veth address in its own network namespace). Peers
    advertise it so that every other worker can reach this one's endpoints."""
    family = socket.AF_INET6 if ":" in coordinator_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((coordinator_host, 9))  # a UDP connect sends nothing: it only picks the route
        return str(probe.getsockname()[0])


def write_error(run_dir: Path, name: str, text: str) -> Path:
    """Append a failure (time, text) to DIR/<name>.error, the run's record of what a peer could not do."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{name}.error"
    with path.open("a") as out:
        out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}\n{text.rstrip()}\n")
    return path


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)  # the harness ends a run with SIGTERM: unwind, so logs close


def run_program(
    description: str,
    coordinator: Callable[[WorkerArgs, argparse.Namespace], None] | None,
    worker: Callable[[WorkerArgs, argparse.Namespace], None],
    add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: list[str] | None = None,
) -> int:
    """Parse the contract's flags (and the peer's own, given to the role as a Namespace), run the role
    asked for; the exit status."""
    parser = worker_parser(description)
    if add_flags is not None:
        add_flags(parser)
    args = parse_worker_args(parser, argv)
    own_flags, _ = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    role = args.role
    name = "coordinator" if role == "coordinator" else f"worker-{args.rank}"
    try:
        if role == "coordinator":
            if coordinator is None:
                raise ValueError(f"{description}: this peer has no coordinator (--role coordinator)")
            coordinator(args, own_flags)
        else:
            worker(args, own_flags)
    except Exception:
        text = traceback.format_exc()
        where = write_error(args.run_dir, name, text)
        print(f"{description}: {name} failed, written to {where}:\n{text}", file=sys.stderr, flush=True)
        return 1
    return 0


def wait_until(deadline: float) -> None:
    """Sleep until `deadline` (time.monotonic()); SIGTERM ends it sooner."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))
