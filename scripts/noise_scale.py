"""The gradient noise scale along one AdamW worker's run, on the character GPT and on the Trainer's
classifier: does the gradient's noise against a worker's batch tell which of the two wants
`LocalSteps(job_betas=True)` (issue 78)?

`job_betas` shortens each worker's momentum (β1 raised to the power of the job's commits per its
own), which makes each AdamW step longer where the gradient is noisy: |m|/√v of a mean over fewer
batches is larger. A job limited by its count of steps (signal against little noise) would gain
from that; one limited by the noise would lose. This measures where each job stands: the simple
noise scale B = tr(Σ)/|G|² (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A), in samples, at points along the reference run (one AdamW worker, as the
replay's `single` and the classifier's `alone`), from K mini-batches of the job's batch b drawn at
the same θ by a generator of their own (the run's batches are untouched):

    S = mean_k |g_k|²,  M = |mean_k g_k|²,  |G|² = (K·M - S)/(K - 1),  tr(Σ) = (S - M)·b·K/(K - 1)

A point's B/b says how many of the worker's batches the noise spans: above 1 a step is
noise-limited. The GPT is `--model user` of scripts/adam_replay_data.py on nanoGPT's schedule (its
replay's settings); the classifier is scripts/hf_classifier.py's BERT under the Trainer alone.

    python scripts/noise_scale.py --job classifier --epochs 8 --seeds 0 1 2
    python scripts/noise_scale.py --job gpt --samples 204800 --warmup 200 --learning-rate 1.5e-3

With `--gauge` (the GPT) the worker's steps go through LocalSteps to a `gemps server --rule
downpour` (one worker: the same AdamW steps, θ kept by the server), and each point also reads the
server's noise-scale gauge, which LocalSteps' gradient sums feed (windows of 8 local steps, a moving
average of about 20 windows: docs/OBSERVABILITY.md, "Update commits"), beside this probe's:

    python scripts/noise_scale.py --job gpt --samples 51200 --warmup 100 --gauge
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from adam_replay_data import Data, flat, load  # beside this script (its directory is on sys.path when run)

from gemps.pytorch import LocalSteps
from gemps.pytorch.noise_sums import DEFAULT_WINDOW
from gemps_worker.cluster import ServerProcess
from gemps_worker.nanogpt import shard_batches

Batch = Any  # a job's mini-batch: (windows, targets) for the GPT, the Trainer's dict for the classifier
Loss = Callable[[torch.nn.Module, Batch], torch.Tensor]
#: the probe's batches are drawn with this seed offset, apart from the run's own
PROBE_SEED = 1009


def noise_scale(model: torch.nn.Module, loss: Loss, batches: list[Batch], batch: int) -> dict[str, float]:
    """B = tr(Σ)/|G|² from `batches` (K of `batch` samples each) at the model's θ."""
    grads = []
    for sample in batches:
        model.zero_grad()
        loss(model, sample).backward()  # type: ignore[no-untyped-call]
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double())
    count = len(grads)
    small = statistics.fmean(float(g.dot(g)) for g in grads)
    mean = torch.stack(grads).mean(dim=0)
    big = float(mean.dot(mean))
    signal = (count * big - small) / (count - 1)
    trace = (small - big) * batch * count / (count - 1)
    scale = trace / signal if signal > 0 else float("inf")
    return {"signal": signal, "trace": trace, "noise_scale": scale, "per_batch": scale / batch}


def gpt_run(args: argparse.Namespace, seed: int) -> list[dict[str, float]]:
    """One AdamW worker on the GPT (the replay's `single`), measured at --points points."""
    torch.manual_seed(seed)
    data = Data("user", seed, batch=args.batch)
    model, probe = data.build(), data.build()
    optimizer = data.optimizer_of(model, args.learning_rate)
    steps = args.samples // data.batch
    schedule = data.schedule_of(optimizer, steps, args.warmup)
    stream = data.batches(0, 1)
    probes = shard_batches(data.train_x, data.train_y, 0, 1, PROBE_SEED + seed, data.batch)
    marks = _marks(steps, args.points)
    points = []
    with contextlib.ExitStack() as stack:
        stepper: torch.optim.Optimizer = optimizer
        if args.gauge:  # the same steps through a server, whose gauge LocalSteps' sums feed
            server = stack.enter_context(ServerProcess(rule="downpour", learning_rate=1.0))
            window = args.noise_window
            stepper = stack.enter_context(LocalSteps(model, optimizer, server.target, steps=1, noise_window=window))
        for step in range(1, steps + 1):
            inputs, targets = next(stream)
            stepper.zero_grad()
            _gpt_loss(model, (inputs, targets)).backward()  # type: ignore[no-untyped-call]
            stepper.step()
            if schedule is not None:
                schedule.step()
            if step in marks:
                theta = flat(model)
                load(probe, theta)
                point = noise_scale(probe, _gpt_loss, [next(probes) for _ in range(args.probes)], data.batch)
                point |= _gauge(stepper) if isinstance(stepper, LocalSteps) else {}
                points.append(
                    {"step": step, "samples": step * data.batch, "held_out_loss": data.held_out(probe, theta), **point}
                )
                _say(points[-1])
    return points


def _gauge(optimizer: LocalSteps) -> dict[str, float]:
    """The server's estimate now, in the worker's batches (NaN before it has one)."""
    noise = optimizer.remote.client.gradient_noise()
    return {"gauge_windows": noise.windows, "gauge_per_batch": noise.useful_workers}


def _gpt_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)  # logits come out (batch, vocabulary, window)


def classifier_run(args: argparse.Namespace, seed: int) -> list[dict[str, float]]:
    """The Trainer alone on the classifier (scripts/hf_classifier.py's `alone`), measured by a
    callback at --points points of its steps."""
    from hf_classifier import BATCH, DigitTokens, accuracy, arguments, tiny_bert
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    torch.set_num_threads(1)
    model, probe = tiny_bert(seed), tiny_bert(seed)
    train = DigitTokens(train=True)
    probes = _classifier_batches(train, BATCH, PROBE_SEED + seed)
    points: list[dict[str, float]] = []
    wanted, drawn = args.points, args.probes

    class Measure(TrainerCallback):
        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
        ) -> None:
            if state.global_step in _marks(state.max_steps, wanted):
                probe.load_state_dict(model.state_dict())
                point = noise_scale(probe, _classifier_loss, [next(probes) for _ in range(drawn)], BATCH)
                samples = state.global_step * BATCH
                points.append({"step": state.global_step, "samples": samples, "accuracy": accuracy(probe), **point})
                _say(points[-1])

    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(model=model, args=arguments(folder, args.epochs, seed * 1000), train_dataset=train)
        trainer.add_callback(Measure())
        trainer.train()
    return points


def _classifier_batches(train: Any, batch: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(train), generator=generator)
        for start in range(0, len(order) - batch + 1, batch):
            index = order[start : start + batch]
            yield {"input_ids": train.input_ids[index], "labels": train.labels[index]}


def _classifier_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    model.train()  # dropout is off in this BERT: train and eval compute the same
    return model(**batch).loss  # type: ignore[no-any-return]


def _finite(point: dict[str, float]) -> dict[str, float | None]:
    """A point for JSON, which has no infinity: an unbounded B (no signal measured) as null."""
    return {key: value if math.isfinite(value) else None for key, value in point.items()}


def _marks(steps: int, points: int) -> set[int]:
    return {max(1, steps * (i + 1) // points) for i in range(points)}


def _say(point: dict[str, float]) -> None:
    shown = ", ".join(f"{key} {value:.4g}" for key, value in point.items() if key not in ("signal", "trace"))
    print(shown, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=["gpt", "classifier"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--points", type=int, default=8, help="measured points along the run")
    parser.add_argument("--probes", type=int, default=32, help="K: mini-batches drawn at each point")
    parser.add_argument("--epochs", type=float, default=8.0, help="classifier: the Trainer's epochs")
    parser.add_argument("--samples", type=int, default=204_800, help="gpt: samples of the run")
    parser.add_argument("--batch", type=int, help="gpt: windows a step (default: the model's 32)")
    parser.add_argument("--learning-rate", type=float, default=1.5e-3, help="gpt: AdamW's peak rate")
    parser.add_argument("--warmup", type=int, default=200, help="gpt: warm-up steps before nanoGPT's cosine")
    parser.add_argument("--gauge", action="store_true", help="gpt: also read a gemps server's gauge (above)")
    parser.add_argument("--noise-window", type=int, default=DEFAULT_WINDOW, help="--gauge: LocalSteps' noise_window")
    parser.add_argument("--json", type=Path, help="write every point here")
    args = parser.parse_args(argv)
    if args.points < 1 or args.probes < 2:
        parser.error("--points must be at least 1 and --probes at least 2 (the estimate needs two batches)")
    if args.gauge and args.job != "gpt":
        parser.error("--gauge reads the gauge along the GPT's run (--job gpt)")
    torch.set_num_threads(1)
    run = gpt_run if args.job == "gpt" else classifier_run
    settings = {key: value for key, value in vars(args).items() if key != "json"}
    runs = {str(seed): run(args, seed) for seed in args.seeds}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        finite = {seed: [_finite(point) for point in points] for seed, points in runs.items()}
        args.json.write_text(json.dumps({"settings": settings, "runs": finite}, indent=1) + "\n")
    for seed, points in runs.items():  # a point's estimate is noisy (K batches): the median over the run
        middle = statistics.median(point["per_batch"] for point in points)
        print(f"seed {seed}: B/b {middle:.3g} (the median of {len(points)} points)", flush=True)
        read = [point["gauge_per_batch"] for point in points if math.isfinite(point.get("gauge_per_batch", math.nan))]
        if read:
            print(f"seed {seed}: the gauge's B/b {statistics.median(read):.3g} (the median of {len(read)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
