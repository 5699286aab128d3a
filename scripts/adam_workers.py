"""Asynchronous AdamW workers through a real gemps server against one AdamW worker alone (issue 59,
item 1), each in a CPU quota of its own, as the comparison's rig gives them.

nanoGPT's character recipe (gemps_worker.nanogpt: a 4-layer character GPT, its AdamW groups and
betas, its warm-up and cosine schedule) on the standard library's source:

- `alone`: one process, the user's AdamW, no server, `--samples` samples;
- `gemps`: `gemps server --rule downpour` and `--workers` processes, each the same AdamW wrapped in
  LocalSteps (`--local-steps` a commit, `--look-ahead`), each on its own shard for its share of
  `--samples` x `--gemps-factor` (its schedule over its own share, as its own train.py would plan).

An observer pulls θ every `--snapshot-every` s (the alone process saves its own); every snapshot is
evaluated on the held-out text after the runs. The record says, at equal samples, the held-out loss
of both (issue bar: within 2 %), and the wall time each took to reach the alone worker's final loss
(issue bar: 2x sooner). Needs root for the quotas (cgroup v1 cpu), as the comparison's rig does.

    sudo .venv/bin/python scripts/adam_workers.py --samples 204800 --gemps-factor 1 2 \\
        --json docs/results/adam/workers.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gemps_bench.alternatives.cgroups import Groups, unavailable_reason

from gemps.client import Client
from gemps.errors import GempsError
from gemps.pytorch import LocalSteps
from gemps_worker.cluster import ServerProcess
from gemps_worker.held_out import evaluate
from gemps_worker.nanogpt import BATCH, LEARNING_RATE, adamw, char_gpt, cosine_schedule, shard_batches
from gemps_worker.text_data import stdlib_text

SCRIPT = Path(__file__).resolve()


def wait_for_go(folder: Path, name: str) -> None:
    """Say ready, then wait until every process of the run is (the clock starts at go)."""
    (folder / f"ready-{name}").touch()
    while not (folder / "go").exists():
        time.sleep(0.05)


def train(args: argparse.Namespace) -> None:
    """One process: `alone` (saving its own snapshots) or one gemps worker of `args.world`."""
    torch.set_num_threads(1)
    train_x, train_y, _, _ = stdlib_text()
    model = char_gpt(0)
    inner = adamw(model, args.learning_rate)
    steps = args.samples // BATCH // args.world
    schedule = cosine_schedule(inner, steps, args.warmup)
    batches = shard_batches(train_x, train_y, args.rank, args.world)
    folder = Path(args.folder)
    if args.role == "alone":
        optimizer: torch.optim.Optimizer = inner
    else:
        optimizer = LocalSteps(model, inner, args.target, steps=args.local_steps, look_ahead=args.look_ahead,
                               name=f"w{args.rank}")  # fmt: skip
    wait_for_go(folder, f"{args.role}-{args.rank}")
    saved = time.time()
    for step in range(1, steps + 1):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step(loss=loss) if isinstance(optimizer, LocalSteps) else optimizer.step()
        schedule.step()
        if args.role == "alone" and (time.time() - saved >= args.snapshot_every or step == steps):
            saved = time.time()
            vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
            np.save(folder / f"snapshot-{saved:.3f}-{step * BATCH}.npy", vector)
    if isinstance(optimizer, LocalSteps):
        optimizer.close()
    (folder / f"done-{args.role}-{args.rank}").touch()


def observe(target: str, folder: Path, every: float, workers: int, samples_per_commit: int) -> None:
    """Pull θ every `every` s until every worker is done, saving each with its time and samples."""
    with Client(target, name="observer") as observer:
        while True:
            finished = len(list(folder.glob("done-*"))) == workers
            try:
                central = observer.pull()
                np.save(folder / f"snapshot-{time.time():.3f}-{central.version * samples_per_commit}.npy", central.flat)
            except GempsError:
                pass  # not yet holding θ
            if finished:
                return
            time.sleep(every)


def launch(args: argparse.Namespace, groups: Groups | None, role: str, rank: int, world: int, samples: int,
           folder: Path, target: str = "") -> subprocess.Popen[bytes]:  # fmt: skip
    argv = [sys.executable, str(SCRIPT), "--role", role, "--rank", str(rank), "--world", str(world),
            "--samples", str(samples), "--folder", str(folder), "--target", target,
            "--learning-rate", repr(args.learning_rate), "--warmup", str(args.warmup),
            "--local-steps", str(args.local_steps), "--look-ahead", repr(args.look_ahead),
            "--snapshot-every", repr(args.snapshot_every)]  # fmt: skip
    if groups is not None:
        cpu = args.alone_cpu if role == "alone" and args.alone_cpu is not None else args.cpu
        argv = [*groups.add(f"{role}{rank}", cpu).enter_argv(), *argv]
    return subprocess.Popen(argv, stdout=sys.stderr, stderr=sys.stderr)


def start_and_wait(processes: list[subprocess.Popen[bytes]], folder: Path) -> float:
    """Say go once every process is ready; the go time, after all of them exited cleanly."""
    while len(list(folder.glob("ready-*"))) < len(processes):
        if any(p.poll() not in (None, 0) for p in processes):
            raise SystemExit("a training process failed before starting: see its output above")
        time.sleep(0.05)
    went = time.time()
    (folder / "go").touch()
    return went


def finish(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"a training process exited with status {process.returncode}: see its output above")


def curve(folder: Path, went: float) -> list[list[float]]:
    """[seconds since go, samples, held-out loss] of every snapshot, in time order."""
    _, _, test_x, test_y = stdlib_text()
    model, points = char_gpt(0), []
    for path in sorted(folder.glob("snapshot-*.npy"), key=lambda p: float(p.stem.split("-")[1])):
        _, at, samples = path.stem.split("-")
        flat = np.load(path)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
        points.append([round(float(at) - went, 2), int(samples), round(evaluate(model, test_x, test_y)[0], 4)])
    return points


def run_alone(args: argparse.Namespace, groups: Groups | None, folder: Path) -> list[list[float]]:
    processes = [launch(args, groups, "alone", 0, 1, args.samples, folder)]
    went = start_and_wait(processes, folder)
    finish(processes)
    return curve(folder, went)


def run_gemps(args: argparse.Namespace, groups: Groups | None, folder: Path, samples: int) -> list[list[float]]:
    with ServerProcess(rule="downpour", metrics_port=-1, log_path=folder / "server.log") as server:
        processes = [launch(args, groups, "worker", r, args.workers, samples, folder, server.target)
                     for r in range(args.workers)]  # fmt: skip
        went = start_and_wait(processes, folder)
        observe(server.target, folder, args.snapshot_every, args.workers, args.local_steps * BATCH)
        finish(processes)
    return curve(folder, went)


def summary(alone: list[list[float]], gemps: dict[float, list[list[float]]]) -> dict[str, Any]:
    """The issue's two bars, from the curves."""
    final_time, final_samples, final_loss = alone[-1]
    result: dict[str, Any] = {"alone": {"samples": final_samples, "loss": final_loss, "seconds": final_time}}
    for factor, points in gemps.items():
        reached = next((t for t, _, loss in points if loss <= final_loss), None)
        result[f"gemps x{factor:g}"] = {
            "samples": points[-1][1], "loss": points[-1][2], "seconds": points[-1][0],
            "loss_vs_alone": round(points[-1][2] / final_loss - 1, 4),
            "seconds_to_alone_loss": reached,
            "sooner": None if reached is None else round(final_time / max(reached, 1e-9), 2),
        }  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=51_200, help="the alone worker's samples")
    parser.add_argument("--gemps-factor", type=float, nargs="+", default=[1.0, 2.0],
                        help="gemps runs of these multiples of --samples (1: equal samples)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cpu", type=float, default=0.4, help="each process's quota, in cores")
    parser.add_argument("--alone-cpu", type=float,
                        help="the alone worker's quota, in cores (default: --cpu); its losses at equal samples "
                             "do not depend on it, its times do")  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps of nanoGPT's schedule")
    parser.add_argument("--local-steps", type=int, default=1, help="LocalSteps' steps a commit")
    parser.add_argument("--look-ahead", type=float, default=1.0, help="LocalSteps' look_ahead")
    parser.add_argument("--snapshot-every", type=float, default=5.0, help="seconds between snapshots")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=("main", "alone", "worker"), default="main", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world"):
        parser.add_argument(hidden, type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("--folder", "--target"):
        parser.add_argument(hidden, default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role != "main":
        train(args)
        return
    reason = unavailable_reason()
    if reason is not None:
        parser.error(f"CPU quotas are needed to give each worker its share: {reason}")
    cores = os.cpu_count() or 1
    if args.alone_cpu is not None and not 0 < args.alone_cpu <= cores - 0.1:
        parser.error(f"--alone-cpu is {args.alone_cpu:g} cores: give more than 0 and at most {cores - 0.1:g}")
    if args.workers * args.cpu > cores - 0.1:
        parser.error(f"--workers x --cpu is {args.workers * args.cpu:g} cores: keep it under {cores - 0.1:g} "
                     f"(this machine has {cores}), so that every process gets its share")  # fmt: skip
    groups = Groups("adam-workers")
    try:
        with tempfile.TemporaryDirectory(prefix="adam-workers-") as scratch:
            root = Path(scratch)
            (root / "alone").mkdir()
            alone = run_alone(args, groups, root / "alone")
            print(f"alone: loss {alone[-1][2]:.4f} after {alone[-1][1]:,} samples, {alone[-1][0]:.0f} s", flush=True)
            gemps = {}
            for factor in args.gemps_factor:
                folder = root / f"gemps-x{factor:g}"
                folder.mkdir()
                gemps[factor] = run_gemps(args, groups, folder, int(args.samples * factor))
                last = gemps[factor][-1]
                print(f"gemps x{factor:g}: loss {last[2]:.4f} after {last[1]:,} samples, {last[0]:.0f} s", flush=True)
    finally:
        groups.close()
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("role", "rank", "world", "folder",
              "target", "json")}, "summary": summary(alone, gemps),
              "alone": alone, "gemps": {f"x{f:g}": c for f, c in gemps.items()}}  # fmt: skip
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
