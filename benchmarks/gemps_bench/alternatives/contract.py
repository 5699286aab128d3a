"""What a worker program of the comparison shares with the harness (CONTRACT.md): its flags, its
progress log and its snapshots.

Every system's worker is a process started as `python -m MODULE --workload W --rank R --world N
--seed S --batch B --lr LR --run-dir DIR --deadline-s T [--snapshot-every S] [--coordinator HOST:PORT]
[--role worker|coordinator] [--optimizer sgd|adamw]`. Once set up, it waits at the start gate
(`ProgressLog.wait_for_go`); then it appends one JSON line per step to DIR/worker-R.jsonl (`ProgressLog`) and, on the
snapshotting rank, writes DIR/snapshots/<wall time>.pt at most every --snapshot-every seconds
(`Snapshots`); the harness reads both after the run. Importable without gemps_server.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from torch import nn

from gemps_bench.alternatives.workloads import WORKLOADS
from gemps_worker.nanogpt import adamw

#: the local optimizers a worker program steps (--optimizer): the contract's SGD with momentum 0.9, or
#: nanoGPT's AdamW (gemps_worker.nanogpt: betas 0.9/0.99, weight decay 0.1 on matrices), both at --lr
OPTIMIZERS = ("sgd", "adamw")
MOMENTUM = 0.9

#: seconds between two snapshots of one run, at least (the default of --snapshot-every)
SNAPSHOT_EVERY = 2.0
#: the start gate: the harness creates it once every rank is set up; the run's clock starts then
GO_FILE = "go"
ROLES = ("worker", "coordinator")


@dataclass(frozen=True)
class WorkerArgs:
    """A worker program's flags, parsed (`parse_worker_args`)."""

    workload: str
    rank: int
    world: int
    seed: int
    batch: int
    lr: float
    run_dir: Path
    deadline_s: float
    coordinator: str
    role: str
    snapshot_every: float = SNAPSHOT_EVERY
    optimizer: str = "sgd"


def worker_parser(description: str) -> argparse.ArgumentParser:
    """The flags every worker program takes (a program may add its own after these)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", required=True, choices=tuple(WORKLOADS))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, required=True, help="samples per step on this worker")
    parser.add_argument("--lr", type=float, required=True, help="learning rate")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, required=True, help="seconds of training from start, then exit")
    parser.add_argument("--snapshot-every", type=float, default=SNAPSHOT_EVERY, help="seconds between snapshots")
    parser.add_argument("--coordinator", default="", help="HOST:PORT of the system's coordinator, where it has one")
    parser.add_argument("--role", default="worker", choices=ROLES)
    parser.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS, help="the local optimizer, at --lr")
    return parser


def parse_worker_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> WorkerArgs:
    args, _ = parser.parse_known_args(argv)
    if not 0 <= args.rank < args.world:
        parser.error(f"--rank {args.rank} must be in [0, --world {args.world})")
    if args.batch < 1 or args.lr <= 0 or args.deadline_s <= 0 or args.snapshot_every <= 0:
        parser.error("--batch, --lr, --deadline-s and --snapshot-every must be positive")
    return WorkerArgs(
        args.workload,
        args.rank,
        args.world,
        args.seed,
        args.batch,
        args.lr,
        args.run_dir,
        args.deadline_s,
        args.coordinator,
        args.role,
        args.snapshot_every,
        args.optimizer,
    )


def local_optimizer(name: str, model: nn.Module, lr: float, beta1: float | None = None) -> torch.optim.Optimizer:
    """The local optimizer `--optimizer name` over `model`'s parameters at `lr` (OPTIMIZERS); AdamW's
    β1 `beta1` where given (nanoGPT's 0.9 otherwise)."""
    if name == "sgd":
        if beta1 is not None:
            raise ValueError(f"a β1 of {beta1:g} is AdamW's; --optimizer sgd steps with momentum {MOMENTUM:g}")
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    if name == "adamw":
        return adamw(model, lr) if beta1 is None else adamw(model, lr, beta1)
    raise ValueError(f"unknown --optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def worker_argv(
    module: str,
    workload: str,
    rank: int,
    world: int,
    seed: int,
    batch: int,
    lr: float,
    run_dir: Path,
    deadline_s: float,
    snapshot_every: float = SNAPSHOT_EVERY,
    optimizer: str = "sgd",
) -> list[str]:
    """The flags of `parse_worker_args` for a program run as `python -m module` (without the python);
    `--optimizer` only where it is not the contract's SGD (the command lines of SGD systems as before)."""
    argv = [
        "-m", module, "--workload", workload, "--rank", str(rank), "--world", str(world), "--seed", str(seed),
        "--batch", str(batch), "--lr", repr(lr), "--run-dir", str(run_dir), "--deadline-s", repr(deadline_s),
        "--snapshot-every", repr(snapshot_every),
    ]  # fmt: skip
    return argv if optimizer == "sgd" else [*argv, "--optimizer", optimizer]


class ProgressLog:
    """DIR/worker-R.jsonl: {"t", "rank", "event": "step", "samples", "applied"} per step (cumulative
    samples this process computed, and those known applied to the shared model), line-buffered and
    appended, so a restarted rank continues the same file (its counts start again from 0)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.samples = 0
        self.applied = 0
        self._file: IO[str] = open(run_dir / f"worker-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.event("start")

    def wait_for_go(self, run_dir: Path, poll: float = 0.05) -> None:
        """Block until the harness opens the start gate (DIR/go): every rank is set up (imports,
        model, connection or rendezvous done) and the run's clock starts. Returns at once for a
        process started again after a kill. Call it after creating the log, before the first step."""
        while not (run_dir / GO_FILE).exists():
            time.sleep(poll)
        self.event("go")

    def step(self, samples: int, applied: int) -> None:
        """`samples` more computed, `applied` more known applied since the last call."""
        self.samples += samples
        self.applied += applied
        self.event("step")

    def event(self, name: str) -> None:
        line = {"t": time.time(), "rank": self.rank, "event": name, "samples": self.samples, "applied": self.applied}
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.event("exit")
        self._file.close()


class Snapshots:
    """DIR/snapshots/<time.time()>.pt, a state_dict of the workload's model, at most every `every` s
    (written to a temporary name, then renamed, so the evaluator never reads half a file)."""

    def __init__(self, run_dir: Path, every: float = SNAPSHOT_EVERY) -> None:
        self.folder = run_dir / "snapshots"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.every = every
        self._last = float("-inf")
        self._last_wall = float("-inf")  # the last snapshot's name, as a time

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every

    def write(self, model: nn.Module, force: bool = False) -> bool:
        """Save `model`'s state_dict when due (or `force`); whether it did."""
        if not (force or self.due()):
            return False
        self._last = time.monotonic()
        # Named to the millisecond: two snapshots within one (a forced one after a due one, on a
        # fast machine) would share a name and the second replace the first; a millisecond later.
        wall = max(round(time.time(), 3), round(self._last_wall + 0.001, 3))
        self._last_wall = wall
        partial = self.folder / f".{wall:.3f}.pt.partial"
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, partial)
        os.replace(partial, self.folder / f"{wall:.3f}.pt")
        return True


def snapshot_times(run_dir: Path) -> list[tuple[float, Path]]:
    """The run's snapshots, (wall time, path), oldest first."""
    folder = run_dir / "snapshots"
    found = [(float(path.stem), path) for path in folder.glob("*.pt")] if folder.exists() else []
    return sorted(found)
