"""A small transformer classifier under Hugging Face's Trainer, through gemps (issue 59, item 1).

A 2-layer BERT (hidden width 64, 77K parameters, built from its config: no download) classifies
scikit-learn's 8x8 digits read as sequences of 64 pixel tokens (17 grey levels, a [CLS] token
first; token 0, BERT's padding, unused).
It needs Adam: with momentum SGD it stays at chance, as it does through RemoteOptimizer
(GEM's proxy is momentum SGD). Each variant runs the Trainer as users write it (its AdamW, its
linear schedule, `learning_rate=1e-3`, weight decay 0.01) for the same number of samples:

- `alone`: one Trainer, its own AdamW, no gemps (the reference);
- `ddp`: what DDP computes with `--workers N` (the mean of N workers' gradients at the same θ, one
  AdamW step each): one Trainer at batch N x 32, so N times fewer steps for the same samples, its
  AdamW at `--ddp-learning-rate` after `--ddp-warmup` (the Trainer's 1e-3 and no warm-up unless
  given: a batch N times larger wants its own, searched);
- `remote`: the SDK guide's way until now: RemoteOptimizer and ServerSchedule, `--rule gem`;
- `adamw:K`: RemoteOptimizer and ServerSchedule on `--rule adamw --round-size K` (1: each gradient
  a step of the server's AdamW, as it arrives; 0: rounds of every worker's, DDP's computation), the
  Trainer's linear schedule on the server (`--lr-schedule warmup-linear` over every commit of the
  run, its warm-up `--gemps-warmup`'s share of them) at `--gemps-learning-rate`;
- `local:H`: the Trainer's own AdamW (`trainer.create_optimizer()`: its weight-decay groups; the
  Trainer then builds its schedule on it) wrapped in LocalSteps (H local steps a commit; 1: every
  step) on a server with `--rule downpour` (the window's update added in full) or `--rule gem`;
- `ahead:H`: `local:H` with LocalSteps' `look_ahead=1` (each window starts where θ is headed while
  the other workers commit: gemps.pytorch.look_ahead);
- `job:H`: `ahead:H` with LocalSteps' `job_betas=True` (each worker's β1 raised to the power of
  the job's commits per its own, so its momentum spans the job's samples that the Trainer's β1
  spans alone: gemps.pytorch.job_betas).
- `win:H`: the SDK guide's rounds of windows ("Fewer commits, few workers"): the Trainer's own AdamW
  in LocalSteps(steps=H, planned_steps=its steps) from each round's θ, the round's move as its
  momentum and β1 raised to 0.95 over the first quarter of its steps (LocalSteps' recipe there), on
  `--rule adamw --outer-rate 1` (the round: every worker's window, averaged).

`--workers N` runs N Trainers as processes on one server, each on its own N-th of the training set
(so N workers see the samples one worker would); the held-out accuracy is then the server's θ's.

    python scripts/hf_classifier.py --variants alone remote local:1 --workers 1 --epochs 8 --seeds 0 1 2
    python scripts/hf_classifier.py --variants local:1 local:4 --workers 4 --epochs 8 --json out.json
    python scripts/hf_classifier.py --variants ddp ahead:1 --workers 4 --epochs 8 --seeds 0 1 2
    python scripts/hf_classifier.py --variants alone job:1 --workers 4 --epochs 24 --seeds 0 1 2 3 4 5
    python scripts/hf_classifier.py --variants adamw:1 adamw:0 --workers 4 --epochs 8 --seeds 0 1 2
    python scripts/hf_classifier.py --variants win:8 --workers 4 --epochs 8 --seeds 0 1 2 --gemps-learning-rate 4e-3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from gemps.client import Client
from gemps.pytorch import LocalSteps, RemoteOptimizer, ServerSchedule, load_central
from gemps_worker.cluster import ServerProcess
from gemps_worker.datasets import load_digits

LEVELS = 17  # pixel values 0..16, tokens 1..17: BERT's token 0 is padding (its embedding stays 0)
CLS = LEVELS + 1  # the [CLS] token's id
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
BATCH = 32


class DigitTokens(Dataset[dict[str, torch.Tensor]]):
    """Digits as token sequences, [CLS] first; `part`/`parts` keeps every parts-th from part."""

    def __init__(self, train: bool, part: int = 0, parts: int = 1) -> None:
        digits = load_digits()
        pixels, labels = (digits.train_x, digits.train_y) if train else (digits.test_x, digits.test_y)
        grey = 1 + np.rint(pixels.reshape(len(pixels), -1) * (LEVELS - 1)).astype(np.int64)
        tokens = np.concatenate([np.full((len(grey), 1), CLS), grey], axis=1)
        self.input_ids = torch.from_numpy(tokens[part::parts])
        self.labels = torch.from_numpy(labels[part::parts].astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def tiny_bert(seed: int) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=CLS + 1, pad_token_id=0, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=65, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config.num_labels = 10
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


@torch.no_grad()
def accuracy(model: BertForSequenceClassification) -> float:
    held_out = DigitTokens(train=False)
    model.eval()
    predicted = model(input_ids=held_out.input_ids).logits.argmax(dim=1)
    return float((predicted == held_out.labels).float().mean())


def arguments(
    folder: str, epochs: float, seed: int, batch: int = BATCH, learning_rate: float = LEARNING_RATE, warmup: float = 0
) -> TrainingArguments:
    """The Trainer's arguments as a user writes them: its AdamW's learning rate, weight decay, and
    its default linear schedule (with `warmup`: the Trainer's warmup_steps, a share of its steps
    below 1)."""
    return TrainingArguments(
        output_dir=folder, learning_rate=learning_rate, weight_decay=WEIGHT_DECAY, num_train_epochs=epochs,
        warmup_steps=int(warmup) if warmup >= 1 else warmup,
        per_device_train_batch_size=batch, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, logging_strategy="no", seed=seed, dataloader_drop_last=True,
    )  # fmt: skip


def train_worker(
    variant: str,
    address: str,
    index: int,
    workers: int,
    epochs: float,
    seed: int,
    learning_rate: float,
    warmup: float = 0,
) -> dict[str, Any]:
    """One Trainer on its part of the training set, through the server at `address`, its AdamW at
    `learning_rate` after `warmup` (warmup_steps)."""
    torch.set_num_threads(1)
    model = tiny_bert(seed)
    data = DigitTokens(train=True, part=index, parts=workers)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        args = arguments(folder, epochs, seed * 1000 + index, learning_rate=learning_rate, warmup=warmup)
        optimizer: RemoteOptimizer | LocalSteps
        if variant == "remote" or variant.startswith("adamw:"):  # gradients: the server's η and schedule
            optimizer = RemoteOptimizer(model, address, name=f"w{index}")
            trainer = Trainer(
                model=model, args=args, train_dataset=data, optimizers=(optimizer, ServerSchedule(optimizer))
            )
        else:  # the Trainer's own AdamW (its decay groups, its linear schedule), its steps committed
            trainer = Trainer(model=model, args=args, train_dataset=data)
            kind, steps = variant.split(":", 1)
            ahead = 1.0 if kind in ("ahead", "job") else 0.0  # LocalSteps' look-ahead: windows start where θ is headed
            planned = planned_steps(len(data), epochs) if kind == "win" else None  # the recipe's β1 ramp
            optimizer = LocalSteps(
                model, trainer.create_optimizer(), address, steps=int(steps), look_ahead=ahead,
                job_betas=kind == "job", planned_steps=planned, name=f"w{index}",
            )  # fmt: skip
            trainer.optimizer = optimizer
        try:
            trainer.train()
        finally:
            optimizer.close()  # LocalSteps commits an unfinished window first; both leave
    # The rate the Trainer's schedule starts from, as AdamW's group holds it (what --gemps-learning-rate
    # set); RemoteOptimizer's belongs to the server, which refuses it to be read as a group's.
    start = optimizer.param_groups[0]["initial_lr"] if isinstance(optimizer, LocalSteps) else None
    steps = trainer.state.max_steps
    return {
        "worker": index, "seconds": time.monotonic() - started, "learning_rate": start, "steps": steps,
        "warmup_steps": args.get_warmup_steps(steps),  # the schedule's, as the Trainer read --gemps-warmup
    }  # fmt: skip


def planned_steps(samples: int, epochs: float) -> int:
    """A worker's optimizer steps over `samples` for `epochs`: whole batches, as the Trainer counts them."""
    return math.ceil(samples // BATCH * epochs)


def run_alone(
    epochs: float, seed: int, batch: int = BATCH, learning_rate: float = LEARNING_RATE, warmup: float = 0
) -> dict[str, Any]:
    """One Trainer on the whole training set, its AdamW at `learning_rate` after `warmup`
    (warmup_steps); at batch N x 32 it takes DDP's steps for N workers."""
    torch.set_num_threads(1)
    model = tiny_bert(seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        args = arguments(folder, epochs, seed * 1000, batch, learning_rate=learning_rate, warmup=warmup)
        trainer = Trainer(model=model, args=args, train_dataset=DigitTokens(train=True))
        trainer.train()
    start = trainer.optimizer.param_groups[0]["initial_lr"]  # the rate its schedule started from
    steps = trainer.state.max_steps
    return {
        "accuracy": accuracy(model), "seconds": time.monotonic() - started, "learning_rate": start,
        "steps": steps, "warmup_steps": args.get_warmup_steps(steps),
    }  # fmt: skip


def server_adamw(round_size: int, workers: int, epochs: float, learning_rate: float, warmup: float) -> dict[str, Any]:
    """The server of `adamw:K`: AdamW at the Trainer's settings (betas, epsilon, its weight decay,
    which the rule's default is), and the Trainer's linear schedule over every commit of the run:
    each worker's steps as the Trainer counts them (whole batches of its part, over the epochs),
    with `warmup` (steps, or below 1 a share) counted in them."""
    parts = (DigitTokens(train=True, part=index, parts=workers) for index in range(workers))
    total = sum(planned_steps(len(part), epochs) for part in parts)
    warm = int(warmup * total) if warmup < 1 else int(warmup)
    return {
        "rule": "adamw", "round_size": round_size, "learning_rate": learning_rate, "adam_weight_decay": WEIGHT_DECAY,
        "lr_schedule": "warmup-linear", "lr_total_commits": total, "lr_warmup_commits": warm,
    }  # fmt: skip


def run_through_gemps(
    variant: str,
    workers: int,
    epochs: float,
    seed: int,
    rule: str,
    learning_rate: float = LEARNING_RATE,
    warmup: float = 0,
) -> dict[str, Any]:
    """`workers` Trainer processes on one server (each its AdamW at `learning_rate` after `warmup`,
    or under `adamw:K` the server's); the held-out accuracy of the server's θ."""
    options: dict[str, Any] = {"rule": "gem" if variant == "remote" else rule, "learning_rate": 0.05}
    if variant.startswith("adamw:"):
        options = server_adamw(int(variant.split(":", 1)[1]), workers, epochs, learning_rate, warmup)
    elif variant.startswith("win:"):  # rounds of every worker's window, averaged (AdamW is the workers')
        options = {"rule": "adamw", "outer_rate": 1.0}
    with ServerProcess(**options) as server:
        worker = "remote" if variant.startswith("adamw:") else variant
        command = [sys.executable, __file__, "--worker", worker, server.target, str(workers), str(epochs), str(seed),
                   repr(learning_rate), repr(warmup)]  # fmt: skip
        started = time.monotonic()
        processes = [subprocess.Popen([*command, str(index)], stdout=subprocess.PIPE) for index in range(workers)]
        reports = []
        for process in processes:
            out, _ = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"a worker of {variant} exited with {process.returncode}")
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        seconds = time.monotonic() - started
        model = tiny_bert(seed)
        with Client(server.target) as observer:
            central = observer.pull()
        load_central(model, central)
    settings = {
        key: options[key]
        for key in ("rule", "round_size", "outer_rate", "lr_total_commits", "lr_warmup_commits")
        if key in options
    }
    return {
        "accuracy": accuracy(model), "seconds": seconds, "version": central.version, "workers": reports,
        "server": settings,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        variant, address, workers, epochs, seed, learning_rate, warmup, index = sys.argv[2:10]
        report = train_worker(
            variant, address, int(index), int(workers), float(epochs), int(seed), float(learning_rate), float(warmup)
        )
        print(json.dumps(report), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["alone", "remote", "local:1"])
    parser.add_argument("--workers", type=int, default=1, help="Trainers through gemps (each its own process)")
    parser.add_argument("--epochs", type=float, default=8.0, help="passes over the training set, all workers together")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rule", default="downpour", choices=["downpour", "gem"], help="the server's rule for local:H")
    parser.add_argument(
        "--gemps-learning-rate",
        type=float,
        default=LEARNING_RATE,
        help="the Trainer's learning_rate in the workers through gemps (alone keeps 1e-3; ddp: --ddp-learning-rate)",
    )
    parser.add_argument(
        "--ddp-learning-rate",
        type=float,
        default=LEARNING_RATE,
        help="ddp's learning_rate: AdamW's at the batch of N workers (the Trainer's 1e-3 unless given)",
    )
    parser.add_argument(
        "--gemps-warmup",
        type=float,
        default=0.0,
        help="the Trainer's warmup_steps in the workers through gemps: steps, or below 1 a share of its steps "
        "(alone keeps none, the Trainer's default; ddp: --ddp-warmup)",
    )
    parser.add_argument(
        "--ddp-warmup",
        type=float,
        default=0.0,
        help="ddp's warmup_steps: steps, or below 1 a share of its steps (none unless given, as the Trainer alone)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    for option, warmup in (("--gemps-warmup", args.gemps_warmup), ("--ddp-warmup", args.ddp_warmup)):
        if not warmup >= 0 or (warmup >= 1 and warmup != int(warmup)):
            parser.error(f"{option} is {warmup:g}: give whole steps, or a share of the steps in [0, 1)")
    for option, rate in (
        ("--gemps-learning-rate", args.gemps_learning_rate),
        ("--ddp-learning-rate", args.ddp_learning_rate),
    ):
        if not rate > 0:
            parser.error(f"{option} is {rate:g}: give a rate above 0")
    for variant in args.variants:
        kind, _, steps = variant.partition(":")
        known = variant in ("alone", "ddp", "remote") or (
            kind in ("local", "ahead", "job", "adamw", "win") and steps.isdigit()
        )
        if not known or (kind != "adamw" and steps == "0"):
            parser.error(
                f"unknown variant {variant!r}: alone, ddp, remote, local:H, ahead:H, job:H, win:H (H >= 1) or adamw:K"
            )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, Any] = {
        "workers": args.workers, "epochs": args.epochs, "rule": args.rule,
        "gemps_learning_rate": args.gemps_learning_rate, "gemps_warmup": args.gemps_warmup,
        "ddp_learning_rate": args.ddp_learning_rate, "ddp_warmup": args.ddp_warmup, "runs": {},
    }  # fmt: skip
    for variant in args.variants:
        runs = []
        for seed in args.seeds:
            if variant == "alone":
                run = run_alone(args.epochs, seed)
            elif variant == "ddp":
                run = run_alone(args.epochs, seed, BATCH * args.workers, args.ddp_learning_rate, args.ddp_warmup)
            else:
                run = run_through_gemps(
                    variant, args.workers, args.epochs, seed, args.rule, args.gemps_learning_rate, args.gemps_warmup
                )
            runs.append(run)
            print(
                f"{variant} seed {seed}: held-out accuracy {run['accuracy']:.4f} in {run['seconds']:.0f} s", flush=True
            )
        mean = statistics.fmean(run["accuracy"] for run in runs)
        results["runs"][variant] = {"mean_accuracy": mean, "runs": runs}
        print(f"{variant}: mean held-out accuracy {mean:.4f} over {len(runs)} seed(s)", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
