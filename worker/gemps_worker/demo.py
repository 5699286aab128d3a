"""Train on this machine: a gemps server and N local worker processes, no containers.

Shows live progress (commits/s, training loss, held-out accuracy, median pi, staleness) and ends
with the held-out accuracy, a checkpoint of the trained model (.npz, no pickle) and a PNG of the
training curves in --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from gemps.client import Client
from gemps.records import CentralVariable
from gemps_server.process import ServerProcess
from gemps_server.rules import rule_names
from gemps_worker.datasets import Dataset, load_dataset
from gemps_worker.evaluation import evaluate, evaluate_central, load_flat
from gemps_worker.launch import worker_command
from gemps_worker.models import MODELS, build_model
from gemps_worker.monitor import ServerFigures, scrape
from gemps_worker.plots import plot_training
from gemps_worker.progress import ProgressLine
from gemps_worker.training import read_report


@dataclass(frozen=True)
class Sample:
    """One look at the run from outside: the evaluator's figures and the server's metrics."""

    time: float
    version: int
    held_out_loss: float
    held_out_accuracy: float
    training_loss: float  # means over the commits since the previous sample
    median_scaling: float
    mean_scaling: float
    mean_staleness: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per worker over the training set (default 10)")
    parser.add_argument("--rule", default="gem", choices=rule_names(), help="commit rule (default gem)")
    parser.add_argument("--learning-rate", type=float, default=0.05, help="eta (default 0.05)")
    parser.add_argument("--model", default="digits-cnn", choices=tuple(MODELS), help="model (default digits-cnn)")
    parser.add_argument("--dataset", default="digits", help="dataset (default digits)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default runs/demo)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between progress updates")
    parser.add_argument(
        "--wire-dtype", default="float32", choices=("float32", "bfloat16"), help="wire format (default float32)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.epochs < 1:
        print("gemps demo: --workers and --epochs must be at least 1", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("worker-*.jsonl"):
        stale.unlink()
    data = load_dataset(args.dataset)
    model = build_model(args.model, data.input_shape, data.num_classes)
    steps_per_worker = args.epochs * (len(data.train_x) // 64)
    print(
        f"gemps demo: {args.workers} workers x {steps_per_worker} steps, rule={args.rule}, "
        f"eta={args.learning_rate}, {args.model} on {args.dataset} ({len(data.train_x)} train / "
        f"{len(data.test_x)} held-out)",
        flush=True,
    )
    started = time.monotonic()
    samples: list[Sample] = []
    with ServerProcess(rule=args.rule, learning_rate=args.learning_rate, log_path=out / "server.log") as server:
        workers = [_start_worker(server.target, args, i, out) for i in range(args.workers)]
        progress = ProgressLine(total=args.workers * steps_per_worker)
        observer = Client(server.target)
        looker = _Looker(observer, f"http://127.0.0.1:{server.metrics_port}/metrics", model, data, started)
        try:
            while True:
                finished = all(w.poll() is not None for w in workers)
                sample = looker.look()
                if sample is not None:
                    samples.append(sample)
                    progress.update(sample.version, _progress_fields(sample, samples))
                if finished:
                    break
                time.sleep(args.interval)
        except KeyboardInterrupt:
            for w in workers:
                w.terminate()
        finally:
            for w in workers:
                w.wait()
            observer.close()
        progress.close()
        failed = [i for i, w in enumerate(workers) if w.returncode != 0]
        with Client(server.target) as reader:
            central = reader.pull()
    if failed:
        print(f"gemps demo: workers {failed} failed; see {out}/worker-*.log", file=sys.stderr)
        return 1
    load_flat(model, central.flat)
    loss, accuracy = evaluate(model, data.test_x, data.test_y)
    elapsed = time.monotonic() - started
    checkpoint = _save_checkpoint(out / "model.npz", central)
    records = {i: read_report(out / f"worker-{i}.jsonl") for i in range(args.workers)}
    (out / "curves.json").write_text(
        json.dumps(
            {
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "run"},
                "held_out": [asdict(s) for s in samples],
                "workers": {i: [asdict(r) for r in rs] for i, rs in records.items()},
            }
        )
    )
    plot = plot_training(out / "training.png", records, samples, title=f"{args.rule}, {args.workers} workers")
    print(
        f"done in {elapsed:.0f}s: version {central.version}, held-out loss {loss:.4f}, "
        f"held-out accuracy {accuracy:.2%}\n"
        f"checkpoint {checkpoint}\ncurves     {plot}\nlogs       {out}/server.log, {out}/worker-*.log"
    )
    return 0


def _start_worker(target: str, args: argparse.Namespace, index: int, out: Path) -> subprocess.Popen[bytes]:
    argv = worker_command(
        target,
        args.dataset,
        args.model,
        "--epochs",
        str(args.epochs),
        "--seed",
        str(index),
        "--name",
        f"worker-{index}",
        "--report-file",
        str(out / f"worker-{index}.jsonl"),
        "--wire-dtype",
        args.wire_dtype,
    )
    with open(out / f"worker-{index}.log", "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


class _Looker:
    """Pulls the central variable, evaluates it on held-out data, reads the server's metrics."""

    def __init__(self, observer: Client, metrics_url: str, model: nn.Module, data: Dataset, started: float) -> None:
        self.observer, self.metrics_url, self.model, self.data, self.started = (
            observer,
            metrics_url,
            model,
            data,
            started,
        )
        self._previous_metrics: dict[str, float] = {}
        self._figures = ServerFigures.unknown()

    def look(self) -> Sample | None:
        measured = evaluate_central(self.observer, self.model, self.data)
        if measured is None:  # not initialised yet (no worker registered), or shutting down
            return None
        version, loss, accuracy = measured
        try:
            metrics = scrape(self.metrics_url)
            self._figures = ServerFigures.between(self._previous_metrics, metrics).or_else(self._figures)
            self._previous_metrics = metrics
        except OSError:
            pass  # keep the last figures
        figures = self._figures
        return Sample(
            time.monotonic() - self.started,
            version,
            loss,
            accuracy,
            figures.training_loss,
            figures.median_scaling,
            figures.mean_scaling,
            figures.mean_staleness,
        )


def _progress_fields(sample: Sample, samples: list[Sample]) -> str:
    rate = 0.0
    if len(samples) >= 2:
        previous = samples[-2]
        rate = (sample.version - previous.version) / max(sample.time - previous.time, 1e-9)
    return (
        f"{rate:5.0f} commits/s  train loss {sample.training_loss:.3f}  held-out {sample.held_out_loss:.3f} "
        f"acc {sample.held_out_accuracy:6.2%}  pi median {sample.median_scaling:.2f} mean {sample.mean_scaling:.2f}  "
        f"staleness {sample.mean_staleness:.1f}"
    )


def _save_checkpoint(path: Path, central: CentralVariable) -> Path:
    """The trained central variable by parameter name, as .npz (loads with allow_pickle=False)."""
    arrays: dict[str, Any] = {**central.named(), "__version__": np.array(central.version)}
    np.savez(path, **arrays)
    return path
