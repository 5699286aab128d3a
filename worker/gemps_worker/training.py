"""The reference worker: register, train on the assigned shard, commit every step, leave."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gemps.client import Client
from gemps.errors import GempsError
from gemps.pytorch import RemoteModel
from gemps_worker.datasets import LOADERS, load_dataset
from gemps_worker.models import MODELS, build_model
from gemps_worker.sharding import epoch_batches

log = logging.getLogger("gemps.worker")


@dataclass(frozen=True)
class WorkerOptions:
    server: str = field(default="127.0.0.1:50051", metadata={"help": "parameter server HOST:PORT"})
    dataset: str = field(default="digits", metadata={"help": "training data", "choices": tuple(LOADERS)})
    model: str = field(default="digits-cnn", metadata={"help": "model to train", "choices": tuple(MODELS)})
    epochs: int = field(default=1, metadata={"help": "passes over this worker's shard"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many commits (0: no limit)"})
    seed: int = field(default=0, metadata={"help": "seed for this worker's data order"})
    name: str = field(default="", metadata={"help": "worker name shown in server logs"})
    device: str = field(default="auto", metadata={"help": "torch device: auto (CUDA when present), cpu, cuda"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads for this worker"})
    report_file: str = field(default="", metadata={"help": "append one JSON line per step here"})


@dataclass(frozen=True)
class StepRecord:
    step: int
    version: int
    loss: float
    staleness: int
    scaling_mean: float
    time: float


@dataclass
class WorkerSummary:
    steps: int = 0
    final_version: int = 0
    first_losses: list[float] = field(default_factory=list)
    last_losses: list[float] = field(default_factory=list)
    stopped_early: bool = False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_worker(options: WorkerOptions, stop: threading.Event | None = None) -> WorkerSummary:
    """Train until the epochs or max_steps are done, or `stop` is set; always leave cleanly."""
    stop = stop or threading.Event()
    torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    data = load_dataset(options.dataset)
    model = build_model(options.model, data.input_shape, data.num_classes).to(device)
    train_x = torch.from_numpy(data.train_x).to(device)
    train_y = torch.from_numpy(data.train_y).to(device)
    summary = WorkerSummary()
    report = open(options.report_file, "a") if options.report_file else None  # noqa: SIM115
    try:
        with RemoteModel(model, Client(options.server, name=options.name)) as remote:
            reg = remote.registration
            if reg.config.worker_mode != "gradient":
                raise GempsError(
                    f"the server asks for worker mode {reg.config.worker_mode!r}; this reference worker "
                    "implements 'gradient' only so far"
                )
            log.info(
                "registered %s: shard %d/%d rule=%s eta=%g batch=%d device=%s",
                reg.worker_id,
                reg.shard.index,
                reg.shard.count,
                reg.config.rule,
                reg.config.learning_rate,
                reg.config.batch_size,
                device,
            )
            for epoch in range(options.epochs):
                batches = epoch_batches(len(train_x), reg.shard, reg.config.batch_size, epoch, options.seed)
                for batch in batches:
                    if stop.is_set() or (options.max_steps and summary.steps >= options.max_steps):
                        summary.stopped_early = stop.is_set()
                        return summary
                    index = torch.from_numpy(batch).to(device)
                    remote.zero_grad()
                    loss = F.cross_entropy(model(train_x[index]), train_y[index])
                    loss.backward()  # type: ignore[no-untyped-call]
                    loss_value = float(loss.detach())
                    result = remote.step(loss=loss_value, num_samples=len(batch))
                    summary.steps += 1
                    summary.final_version = result.version
                    _remember(summary, loss_value)
                    if report is not None:
                        record = StepRecord(
                            summary.steps,
                            result.version,
                            loss_value,
                            result.staleness,
                            result.scaling_mean,
                            time.time(),
                        )
                        report.write(json.dumps(asdict(record)) + "\n")
    finally:
        if report is not None:
            report.close()
    return summary


def _remember(summary: WorkerSummary, loss: float, keep: int = 10) -> None:
    if len(summary.first_losses) < keep:
        summary.first_losses.append(loss)
    summary.last_losses = [*summary.last_losses[-(keep - 1) :], loss]


def read_report(path: Path) -> list[StepRecord]:
    if not path.exists():
        return []
    return [StepRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")
