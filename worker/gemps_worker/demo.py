"""Train on this machine: a gemps server and N local worker processes, no containers.

Shows live progress (commits/s, training loss, held-out accuracy, median pi, staleness, the
server's gradient noise scale and how many workers it says pay) and ends
with the held-out accuracy, a checkpoint of the trained model (.npz, no pickle) and a PNG of the
training curves in --out.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from gemps.client import Client
from gemps.errors import GempsError
from gemps.options import values_of
from gemps.pytorch import load_central
from gemps.records import CentralVariable, GradientNoise
from gemps_proto.schema import TrainingConfig
from gemps_proto.tensor_codec import WIRE_DTYPE_NAMES
from gemps_worker.cluster import LocalCluster
from gemps_worker.commit_log import CommitFigures, ReportTail
from gemps_worker.datasets import DATASETS, Dataset, load_dataset
from gemps_worker.held_out import evaluate, evaluate_central
from gemps_worker.models import MODELS, build_model
from gemps_worker.progress import ProgressLine
from gemps_worker.training import StepRecord, read_report
from gemps_worker.training_plot import plot_training


@dataclass(frozen=True)
class DemoOptions:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    workers: int = field(default=4, metadata={"help": "worker processes"})
    partitions: int = field(
        default=1, metadata={"help": "server processes, each holding one range of θ (gemps server --partitions)"}
    )
    epochs: int = field(default=10, metadata={"help": "epochs per worker over the training set"})
    model: str = field(default="digits-cnn", metadata={"help": "model", "choices": tuple(MODELS)})
    dataset: str = field(default="digits", metadata={"help": "dataset", "choices": DATASETS})
    out: str = field(default="runs/demo", metadata={"help": "output folder"})
    interval: float = field(default=0.5, metadata={"help": "seconds between progress updates"})
    wire_dtype: str = field(
        default="float32", metadata={"help": "wire format of commits and replies", "choices": tuple(WIRE_DTYPE_NAMES)}
    )

    def problems(self) -> list[str]:
        if self.workers < 1 or self.epochs < 1 or self.partitions < 1:
            return ["workers, epochs and partitions must be at least 1"]
        return []


@dataclass(frozen=True)
class ProgressSample:
    """One look at the run from outside: the evaluator's figures and the workers' commit replies."""

    time: float
    version: int
    held_out_loss: float
    held_out_accuracy: float
    training_loss: float  # means over the commits since the previous sample
    median_scaling: float
    mean_scaling: float
    mean_staleness: float
    noise_scale: float = math.nan  # the server's gradient noise scale, samples (Status.gradient_noise)
    useful_workers: float = math.nan  # and in workers of the batch size it assumes


def run_demo(options: DemoOptions) -> int:
    """Train; print progress and the result; write the model, curves and logs to `options.out`."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("worker-*.jsonl"):
        stale.unlink()
    data = load_dataset(options.dataset)
    model = build_model(options.model, data.input_shape, data.num_classes)
    training = options.training
    steps_per_worker = options.epochs * (len(data.train_x) // training.batch_size)
    print(
        f"gemps demo: {options.workers} workers x {steps_per_worker} steps, rule={training.rule}, "
        f"eta={training.learning_rate}, {options.model} on {options.dataset} ({len(data.train_x)} train / "
        f"{len(data.test_x)} held-out)" + (f", θ in {options.partitions} partitions" if options.partitions > 1 else ""),
        flush=True,
    )
    started = time.monotonic()
    samples: list[ProgressSample] = []
    reports = [out / f"worker-{i}.jsonl" for i in range(options.workers)]
    with LocalCluster(out, server={**values_of(training), "partitions": options.partitions}) as cluster:
        for i, report in enumerate(reports):
            cluster.start_worker(
                f"worker-{i}",
                dataset=options.dataset,
                model=options.model,
                epochs=options.epochs,
                seed=i,
                report_file=report,
                wire_dtype=options.wire_dtype,
            )
        progress = ProgressLine(total=options.workers * steps_per_worker)
        looker = _Looker(cluster.observer(), [ReportTail(r) for r in reports], model, data, started)
        try:
            while True:
                finished = not cluster.running()
                sample = looker.look()
                if sample is not None:
                    samples.append(sample)
                    progress.update(sample.version, _progress_fields(sample, samples))
                if finished:
                    break
                time.sleep(options.interval)
        except KeyboardInterrupt:
            cluster.stop_processes()
        progress.close()
        cluster.wait_processes()
        failed = cluster.failed()
        central = cluster.observer().pull()
    if failed:
        print(f"gemps demo: {', '.join(failed)} failed; see {out}/worker-*.log", file=sys.stderr)
        return 1
    load_central(model, central)
    loss, accuracy = evaluate(model, data.test_x, data.test_y)
    elapsed = time.monotonic() - started
    checkpoint = _save_checkpoint(out / "model.npz", central)
    records = {i: read_report(report) for i, report in enumerate(reports)}
    (out / "curves.json").write_text(
        json.dumps(
            {
                "settings": values_of(options),
                "held_out": [asdict(s) for s in samples],
                "workers": {i: [asdict(r) for r in rs] for i, rs in records.items()},
            }
        )
    )
    plot = plot_training(out / "training.png", records, samples, title=f"{training.rule}, {options.workers} workers")
    print(
        f"done in {elapsed:.0f}s: version {central.version}, held-out loss {loss:.4f}, "
        f"held-out accuracy {accuracy:.2%}\n"
        f"checkpoint {checkpoint}\ncurves     {plot}\nlogs       {out}/server.log, {out}/worker-*.log"
    )
    return 0


class _Looker:
    """Pulls the central variable and evaluates it on held-out data; averages the commits the
    workers reported since the last look."""

    def __init__(
        self, observer: Client, reports: list[ReportTail], model: nn.Module, data: Dataset, started: float
    ) -> None:
        self.observer, self.reports, self.model, self.data, self.started = observer, reports, model, data, started
        self._figures = CommitFigures.unknown()

    def look(self) -> ProgressSample | None:
        measured = evaluate_central(self.observer, self.model, self.data)
        if measured is None:  # not initialised yet (no worker registered), or shutting down
            return None
        version, loss, accuracy = measured
        new: list[StepRecord] = [record for report in self.reports for record in report.read_new()]
        self._figures = CommitFigures.of(new).or_else(self._figures)
        figures = self._figures
        try:
            noise = self.observer.gradient_noise()
        except GempsError:  # shutting down: the next look, if any, reads it again
            noise = GradientNoise()
        return ProgressSample(
            time.monotonic() - self.started,
            version,
            loss,
            accuracy,
            figures.training_loss,
            figures.median_scaling,
            figures.mean_scaling,
            figures.mean_staleness,
            noise.scale,
            noise.useful_workers,
        )


def _progress_fields(sample: ProgressSample, samples: list[ProgressSample]) -> str:
    rate = 0.0
    if len(samples) >= 2:
        previous = samples[-2]
        rate = (sample.version - previous.version) / max(sample.time - previous.time, 1e-9)
    return (
        f"{rate:5.0f} commits/s  train loss {sample.training_loss:.3f}  held-out {sample.held_out_loss:.3f} "
        f"acc {sample.held_out_accuracy:6.2%}  pi median {sample.median_scaling:.2f} mean {sample.mean_scaling:.2f}  "
        f"staleness {sample.mean_staleness:.1f}  {_noise_field(sample)}"
    )


def _noise_field(sample: ProgressSample) -> str:
    """The noise scale and what it says; while there is no estimate (too few windows yet, or its
    estimate of |G|^2 not positive: early, and again near convergence, where the mean gradient is
    tiny against its noise) it says nothing."""
    if not math.isfinite(sample.noise_scale):
        return "noise scale n/a (no estimate now)"
    return f"noise scale {sample.noise_scale:.0f} (~{sample.useful_workers:.1f} workers pay)"


def _save_checkpoint(path: Path, central: CentralVariable) -> Path:
    """The trained central variable and buffers by name, as .npz (loads with allow_pickle=False)."""
    arrays: dict[str, Any] = {**central.state_dict(), "__version__": np.array(central.version)}
    np.savez(path, **arrays)
    return path
