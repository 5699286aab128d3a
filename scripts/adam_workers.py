"""Asynchronous AdamW workers through a real gemps server against one AdamW worker alone (issue 59,
item 1), each in a CPU quota of its own, as the comparison's rig gives them.

nanoGPT's character recipe (gemps_worker.nanogpt: a 4-layer character GPT, its AdamW groups and
betas, its warm-up and cosine schedule) on the standard library's source:

- `alone`: one process, the user's AdamW, no server, `--samples` samples;
- `ddp` (`--reference ddp`, instead of `alone`): DDP-AdamW's computation on `--workers` machines in
  one process: each step one AdamW step on the mean gradient of every worker's batch from its own
  shard (a global batch of `--workers` x the batch), `--samples` samples: the reference a team with
  that many machines would run (issue 78). Its losses at equal samples are DDP's; its times are one
  process's, so no "sooner" is judged against it. Either reference trains at `--reference-learning-rate`
  and `--reference-warmup` where given (else the workers' `--learning-rate` and `--warmup`);
- `gemps`: `gemps server --rule downpour` (`--rule`, `--server-option NAME=VALUE`) and `--workers`
  processes, each the same AdamW (β1 `--beta1`) wrapped in LocalSteps (`--local-steps` a commit,
  `--look-ahead`), each on its own shard for its share of `--samples` x `--gemps-factor` (its
  schedule over its own share, as its own train.py would plan).

Every process starts from the model of `--seed` and trains on that seed's split and order of the
data (0: the records' runs). An observer pulls θ every `--snapshot-every` s (the alone process
saves its own); every snapshot is evaluated on the held-out text after the runs. The record says,
at equal samples, the held-out loss of both at the end and at the middle (issue bar: within 2 %),
and the wall time each took to reach the alone worker's final loss (issue bar: 2x sooner). Needs
root for the quotas (cgroup v1 cpu), as the comparison's rig does.

    sudo .venv/bin/python scripts/adam_workers.py --samples 204800 --gemps-factor 1 2 \\
        --json docs/results/adam/workers.json

GEM energy-matched to each worker's AdamW step, 16 workers of a tenth of a core, against DDP-AdamW at
a global batch of 256 (docs/RESULTS.md, "The energy-matched rule through the real server at 16 workers"):

    sudo .venv/bin/python scripts/adam_workers.py --workers 16 --cpu 0.1 --alone-cpu 1.8 \\
        --samples 204800 --gemps-factor 1 --rule gem --server-option momentum=0 --server-option kappa=2 \\
        --server-option pi_max=1 --server-option gem_own_step=excluded --look-ahead 0 --beta1 0.5 \\
        --reference ddp --reference-learning-rate 3e-3 --reference-warmup 20 --snapshot-every 20

Rounds of 16 workers' windows of 8 local AdamW steps, averaged (`--server-option outer_rate=1`: each
worker LocalSteps over its own AdamW and schedule), int8 codes both ways:

    sudo .venv/bin/python scripts/adam_workers.py --workers 16 --cpu 0.1 --alone-cpu 1.8 \\
        --samples 204800 --gemps-factor 1 --rule adamw --server-option outer_rate=1 --local-steps 8 \\
        --compression int8 --learning-rate 1e-3 --warmup 20 --reference ddp --reference-learning-rate 3e-3 \\
        --snapshot-every 20

AdamW on the server, DDP's computation a round of 16 gradients at a time (`--rule adamw`: the workers
commit gradients through RemoteOptimizer; the server takes --learning-rate, --warmup in rounds,
nanoGPT's betas and decay and its cosine after the warm-up), against DDP-AdamW at a global batch of 256:

    sudo .venv/bin/python scripts/adam_workers.py --workers 16 --cpu 0.1 --alone-cpu 1.8 \\
        --samples 204800 --gemps-factor 1 --rule adamw --learning-rate 3e-3 --warmup 20 \\
        --reference ddp --snapshot-every 20

The user's setting of issue 78 (`--shape user`: 2 layers of width 128 at batch 32), 4 workers against
one AdamW worker at nanoGPT's 1e-3 and 100 warm-up steps (docs/RESULTS.md, "The user's own setting"):

    sudo .venv/bin/python scripts/adam_workers.py --shape user --workers 4 --cpu 0.45 --alone-cpu 1.8 \\
        --samples 204800 --gemps-factor 1 --learning-rate 1.5e-3 --warmup 200 \\
        --reference-learning-rate 1e-3 --reference-warmup 100 --snapshot-every 10
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gemps_bench.alternatives.cgroups import Groups, unavailable_reason

from gemps.client import Client
from gemps.errors import GempsError
from gemps.pytorch import Beta1Ramp, LocalSteps, RemoteOptimizer
from gemps.pytorch.beta1_ramp import RECIPE_SHARE
from gemps_worker.cluster import ServerProcess
from gemps_worker.held_out import evaluate
from gemps_worker.nanogpt import BETAS, LEARNING_RATE, SHAPES, adamw, char_gpt, cosine_schedule, shard_batches
from gemps_worker.text_data import stdlib_text

SCRIPT = Path(__file__).resolve()
REFERENCES = ("alone", "ddp")  # what the gemps workers are held against


def wait_for_go(folder: Path, name: str) -> None:
    """Say ready, then wait until every process of the run is (the clock starts at go)."""
    (folder / f"ready-{name}").touch()
    while not (folder / "go").exists():
        time.sleep(0.05)


def train(args: argparse.Namespace) -> None:
    """One process: a reference, `alone` or `ddp` (saving its own snapshots), or one gemps worker of `args.world`."""
    torch.set_num_threads(1)
    train_x, train_y, _, _ = stdlib_text()
    shape = SHAPES[args.shape]
    model = char_gpt(args.seed, shape)
    inner = adamw(model, args.learning_rate, args.beta1)
    steps = args.samples // shape.batch // args.world
    schedule = cosine_schedule(inner, steps, args.warmup)
    ramped = args.beta1_to is not None and args.role not in REFERENCES  # the windows recipe's β1
    ramp = Beta1Ramp(inner, args.beta1_to, max(1, round(args.beta1_ramp * steps))) if ramped else None
    batches = ddp_batches(train_x, train_y, args.world, shape.batch, args.seed) if args.role == "ddp" else \
        shard_batches(train_x, train_y, args.rank, args.world, args.seed, shape.batch)  # fmt: skip
    folder = Path(args.folder)
    if args.role in REFERENCES:
        optimizer: torch.optim.Optimizer = inner
    elif args.rule == "adamw" and not averaged(args):  # gradients: the server's AdamW and schedule
        optimizer = RemoteOptimizer(model, args.target, name=f"w{args.rank}")
    else:
        codes = {"compression": args.compression, "reply_compression": args.compression}
        optimizer = LocalSteps(model, inner, args.target, steps=args.local_steps, look_ahead=args.look_ahead,
                               round_momentum=args.round_momentum, name=f"w{args.rank}", **codes)  # fmt: skip
    wait_for_go(folder, f"{args.role}-{args.rank}")
    saved = time.time()
    for step in range(1, steps + 1):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step(loss=loss) if isinstance(optimizer, LocalSteps | RemoteOptimizer) else optimizer.step()
        if not isinstance(optimizer, RemoteOptimizer):  # else the server's schedule
            schedule.step()
        if ramp is not None:
            ramp.step()
        if args.role in REFERENCES and (time.time() - saved >= args.snapshot_every or step == steps):
            saved = time.time()
            vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
            np.save(folder / f"snapshot-{saved:.3f}-{step * shape.batch * args.world}.npy", vector)  # alone: world 1
    if isinstance(optimizer, LocalSteps | RemoteOptimizer):
        optimizer.close()
    (folder / f"done-{args.role}-{args.rank}").touch()


def ddp_batches(
    inputs: np.ndarray, targets: np.ndarray, world: int, batch: int = SHAPES["project"].batch, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """DDP's global batch: every one of `world` ranks' mini-batch of `batch` from its own shard,
    together (the mean loss over them is the mean of the ranks' losses, so its gradient is DDP's
    all-reduced one)."""
    streams = [shard_batches(inputs, targets, rank, world, seed, batch) for rank in range(world)]
    while True:
        parts = [next(stream) for stream in streams]
        yield torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


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
    reference = role in REFERENCES
    learning_rate = (
        args.reference_learning_rate if reference and args.reference_learning_rate is not None else args.learning_rate
    )
    warmup = args.reference_warmup if reference and args.reference_warmup is not None else args.warmup
    beta1 = BETAS[0] if reference else args.beta1  # the reference is nanoGPT's AdamW as written
    argv = [sys.executable, str(SCRIPT), "--role", role, "--rank", str(rank), "--world", str(world),
            "--samples", str(samples), "--folder", str(folder), "--target", target, "--seed", str(args.seed),
            "--learning-rate", repr(learning_rate), "--warmup", str(warmup), "--beta1", repr(beta1),
            *(() if reference or args.beta1_to is None else
              ("--beta1-to", repr(args.beta1_to), "--beta1-ramp", repr(args.beta1_ramp))),
            "--local-steps", str(args.local_steps), "--look-ahead", repr(args.look_ahead),
            *(("--round-momentum",) if args.round_momentum and not reference else ()),
            *(("--compression", args.compression) if args.compression else ()),
            *(f"--server-option={option}" for option in args.server_option),
            "--snapshot-every", repr(args.snapshot_every), "--shape", args.shape, "--rule", args.rule]  # fmt: skip
    if groups is not None:
        cpu = args.alone_cpu if role in REFERENCES and args.alone_cpu is not None else args.cpu
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


def curve(folder: Path, went: float, shape: str) -> list[list[float]]:
    """[seconds since go, samples, held-out loss] of every snapshot, in time order."""
    _, _, test_x, test_y = stdlib_text()
    model, points = char_gpt(0, SHAPES[shape]), []
    for path in sorted(folder.glob("snapshot-*.npy"), key=lambda p: float(p.stem.split("-")[1])):
        _, at, samples = path.stem.split("-")
        flat = np.load(path)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
        points.append([round(float(at) - went, 2), int(samples), round(evaluate(model, test_x, test_y)[0], 4)])
    return points


def run_reference(args: argparse.Namespace, groups: Groups | None, folder: Path) -> list[list[float]]:
    world = args.workers if args.reference == "ddp" else 1
    processes = [launch(args, groups, args.reference, 0, world, args.samples, folder)]
    went = start_and_wait(processes, folder)
    finish(processes)
    return curve(folder, went, args.shape)


def averaged(args: argparse.Namespace) -> bool:
    """Under `adamw` with `--server-option outer_rate=R`: rounds of LocalSteps' windows, averaged
    (each worker its own AdamW and schedule), where without it the workers commit gradients."""
    return args.rule == "adamw" and any(option.startswith("outer_rate=") for option in args.server_option)


def server_options(args: argparse.Namespace, samples: int) -> dict[str, Any]:
    """The server's options: under `adamw` with gradients, the workers' rate, nanoGPT's betas and
    decay, its warm-up of --warmup steps ((W + 1) rounds of commits: scripts/adam_rounds.py says why)
    and its cosine after it to a tenth at the run's end; then --server-option's."""
    options: dict[str, Any] = {}
    if args.rule == "adamw" and not averaged(args):
        commits = samples // SHAPES[args.shape].batch
        options = {"learning_rate": args.learning_rate, "adam_beta1": args.beta1, "adam_beta2": BETAS[1],
                   "adam_weight_decay": 0.1, "lr_schedule": "warmup-cosine",
                   "lr_warmup_commits": (args.warmup + 1) * args.workers, "lr_total_commits": commits,
                   "lr_min": args.learning_rate / 10}  # fmt: skip
    return options | dict(option.split("=", 1) for option in args.server_option)


def run_gemps(args: argparse.Namespace, groups: Groups | None, folder: Path, samples: int) -> list[list[float]]:
    options = server_options(args, samples)
    with ServerProcess(rule=args.rule, metrics_port=-1, log_path=folder / "server.log", **options) as server:
        processes = [launch(args, groups, "worker", r, args.workers, samples, folder, server.target)
                     for r in range(args.workers)]  # fmt: skip
        went = start_and_wait(processes, folder)
        observe(server.target, folder, args.snapshot_every, args.workers, args.local_steps * SHAPES[args.shape].batch)
        finish(processes)
    return curve(folder, went, args.shape)


def loss_at(points: list[list[float]], samples: float) -> float | None:
    """The held-out loss at `samples`, linear between the snapshots either side (None outside them)."""
    for (_, before, low), (_, after, high) in itertools.pairwise(points):
        if before <= samples <= after:
            return round(low + (high - low) * (samples - before) / max(after - before, 1), 4)
    return None


def summary(reference: str, curve: list[list[float]], gemps: dict[float, list[list[float]]]) -> dict[str, Any]:
    """The issue's bars, from the curves: the loss at equal samples, at the end and at the middle,
    and (against one worker alone, whose times are a worker's) how much sooner its final loss came."""
    final_time, final_samples, final_loss = curve[-1]
    middle = loss_at(curve, final_samples / 2)
    result: dict[str, Any] = {reference: {"samples": final_samples, "loss": final_loss, "seconds": final_time,
                                          "loss_at_middle": middle}}  # fmt: skip
    for factor, points in gemps.items():
        reached = next((t for t, _, loss in points if loss <= final_loss), None)
        at_middle = loss_at(points, final_samples / 2)
        result[f"gemps x{factor:g}"] = {
            "samples": points[-1][1], "loss": points[-1][2], "seconds": points[-1][0],
            f"loss_vs_{reference}": round(points[-1][2] / final_loss - 1, 4),
            "loss_at_middle": at_middle,
            f"middle_vs_{reference}": None if middle is None or at_middle is None else round(at_middle / middle - 1, 4),
            f"seconds_to_{reference}_loss": reached,
            "sooner": None if reached is None or reference != "alone" else round(final_time / max(reached, 1e-9), 2),
        }  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=51_200, help="the alone worker's samples")
    parser.add_argument("--gemps-factor", type=float, nargs="+", default=[1.0, 2.0],
                        help="gemps runs of these multiples of --samples (1: equal samples)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation, the shards' split and order")
    parser.add_argument("--cpu", type=float, default=0.4, help="each process's quota, in cores")
    parser.add_argument("--alone-cpu", type=float,
                        help="the reference's quota, in cores (default: --cpu); its losses at equal samples "
                             "do not depend on it, its times do")  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps of nanoGPT's schedule")
    parser.add_argument("--beta1", type=float, default=BETAS[0], help="the gemps workers' AdamW β1 (nanoGPT's 0.9)")
    parser.add_argument("--beta1-to", type=float,
                        help="the gemps workers' β1 rises from --beta1 to this (gemps.pytorch.Beta1Ramp)")  # fmt: skip
    parser.add_argument("--beta1-ramp", type=float,
                        help="the share of each worker's steps --beta1-to is reached over (a quarter)")  # fmt: skip
    parser.add_argument("--round-momentum", action="store_true",
                        help="the gemps workers' LocalSteps(round_momentum=True) (rounds of windows)")  # fmt: skip
    parser.add_argument("--rule", default="downpour", help="the server's --rule")
    parser.add_argument("--server-option", action="append", default=[], metavar="NAME=VALUE",
                        help="another server option (kappa=2: --kappa 2), repeatable")  # fmt: skip
    parser.add_argument("--reference", choices=REFERENCES, default="alone",
                        help="one AdamW worker alone, or DDP-AdamW's computation on --workers machines")  # fmt: skip
    parser.add_argument("--reference-learning-rate", type=float,
                        help="the reference's AdamW rate, alone or DDP's (default: --learning-rate)")  # fmt: skip
    parser.add_argument("--reference-warmup", type=int, help="the reference's warm-up steps (default: --warmup)")
    parser.add_argument("--local-steps", type=int, default=1, help="LocalSteps' steps a commit")
    parser.add_argument("--look-ahead", type=float, default=1.0, help="LocalSteps' look_ahead")
    parser.add_argument("--compression", choices=("int8", "int4"),
                        help="LocalSteps' codes both ways (compression, reply_compression); else float32")  # fmt: skip
    parser.add_argument("--shape", choices=tuple(SHAPES), default="project",
                        help="the GPT and batch: the project's (4 layers, width 96, batch 16) or the user's "
                        "of issue 78 (2 layers, width 128, batch 32)")  # fmt: skip
    parser.add_argument("--snapshot-every", type=float, default=5.0, help="seconds between snapshots")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=("main", *REFERENCES, "worker"), default="main", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world"):
        parser.add_argument(hidden, type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("--folder", "--target"):
        parser.add_argument(hidden, default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role != "main":
        train(args)
        return
    if args.seed < 0:
        parser.error(f"--seed is {args.seed}: give 0 or more")
    if not 0 <= args.beta1 < 1:
        parser.error(f"--beta1 is {args.beta1:g}: AdamW's β1 lies in [0, 1)")
    if args.beta1_to is not None and not 0 <= args.beta1_to < 1:
        parser.error(f"--beta1-to is {args.beta1_to:g}: AdamW's β1 lies in [0, 1)")
    if args.beta1_to is not None and args.rule == "adamw" and not averaged(args):
        parser.error("--beta1-to ramps the workers' own AdamW: under --rule adamw they commit gradients")
    if args.beta1_ramp is not None and args.beta1_to is None:
        parser.error(f"--beta1-ramp {args.beta1_ramp:g} without --beta1-to: give the β1 it rises to")
    if args.round_momentum and not averaged(args):
        parser.error("--round-momentum is for rounds of windows: --rule adamw --server-option outer_rate=R")
    args.beta1_ramp = RECIPE_SHARE if args.beta1_ramp is None else args.beta1_ramp
    if not 0 < args.beta1_ramp <= 1:
        parser.error(f"--beta1-ramp is {args.beta1_ramp:g}: a share of the steps, above 0 and at most 1")
    if args.reference_learning_rate is not None and not args.reference_learning_rate > 0:
        parser.error(f"--reference-learning-rate is {args.reference_learning_rate:g}: give a rate above 0")
    if args.reference_warmup is not None and args.reference_warmup < 0:
        parser.error(f"--reference-warmup is {args.reference_warmup}: give 0 or more steps")
    malformed = [option for option in args.server_option if "=" not in option]
    if malformed:
        parser.error(f"--server-option takes NAME=VALUE (kappa=2): {malformed[0]!r} has no '='")
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
            (root / args.reference).mkdir()
            reference = run_reference(args, groups, root / args.reference)
            last = reference[-1]
            print(f"{args.reference}: loss {last[2]:.4f} after {last[1]:,} samples, {last[0]:.0f} s", flush=True)
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
              "target", "json")}, "summary": summary(args.reference, reference, gemps),
              args.reference: reference, "gemps": {f"x{f:g}": c for f, c in gemps.items()}}  # fmt: skip
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
