"""The reference worker: register, train on the assigned shard, commit, leave cleanly."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from gemps.client import Client
from gemps.errors import StoppedError
from gemps.pytorch import RemoteModel
from gemps.records import Registration
from gemps.resolver import Target
from gemps.retry import DEFAULT_PATIENCE, RetryPolicy
from gemps.wire_options import PLANES
from gemps_proto.jobs import MAX_JOB_LENGTH, valid_job
from gemps_proto.ranges import (
    COUNT,
    COUNT_OR_ZERO,
    FLOAT32_MAX,
    INT64_MAX,
    MAX_SECONDS,
    RANGE,
    SECONDS,
    SECONDS_OR_ZERO,
    THREADS,
    Range,
    out_of_range,
)
from gemps_proto.reply_differences import REPLY_COMPRESSIONS
from gemps_proto.tensor_codec import COMPRESSIONS, WIRE_DTYPE_NAMES
from gemps_worker.datasets import DATASETS, Dataset, load_dataset
from gemps_worker.mode_options import read_by, unread_options
from gemps_worker.models import MODELS, build_model
from gemps_worker.modes import LOCAL_OPTIMIZERS, MODES, Committed, Diverged, LocalTraining, WorkerMode, create_mode
from gemps_worker.progress import WorkerProgress
from gemps_worker.sharding import epoch_batches

log = logging.getLogger("gemps.worker")


@dataclass(frozen=True)
class WorkerOptions:
    server: str = field(default="127.0.0.1:50051", metadata={"help": "parameter server HOST:PORT"})
    dataset: str = field(default="digits", metadata={"help": "training data", "choices": DATASETS})
    data_dir: str = field(default="data", metadata={"help": "folder of IDX files for mnist / fashion-mnist"})
    download: bool = field(default=True, metadata={"help": "download missing IDX files (checksums verified)"})
    model: str = field(default="digits-cnn", metadata={"help": "model to train", "choices": tuple(MODELS)})
    mode: str = field(default=WorkerMode.GRADIENT.value, metadata={"help": "worker mode", "choices": MODES})
    agn_steps: int = field(default=4, metadata={"help": "agn: local steps (lambda) per commit", RANGE: COUNT})
    dynsgd_steps: int = field(default=10, metadata={"help": "dynsgd: local steps (lambda) per commit", RANGE: COUNT})
    dylu_steps: int = field(
        default=10,
        metadata={
            "help": "dylu: the fastest worker's local steps (H) per commit; each worker takes floor(v/v_max * H), "
            "at least 1, v its samples/s as the server's status reports them (rule delayed-nesterov: DN+DyLU)",
            RANGE: COUNT,
        },
    )
    easgd_alpha: float = field(
        default=0.5,
        metadata={"help": "easgd: elastic moving rate alpha (= eta * rho)", RANGE: Range(0, 1, low_open=True)},
    )
    easgd_period: int = field(default=4, metadata={"help": "easgd: local steps (tau) between commits", RANGE: COUNT})
    local_optimizer: str = field(
        default="sgd",
        metadata={
            "help": f"{read_by('local_optimizer')}: optimizer of the local steps (sgd; momentum: sgd with the "
            "server's mu; adam; momentum and adam keep their state across windows); refused in another mode",
            "choices": tuple(LOCAL_OPTIMIZERS),
        },
    )
    local_learning_rate: float = field(
        default=0.0,
        metadata={
            "help": f"{read_by('local_learning_rate')}: local steps' learning rate; 0: sgd and momentum the "
            "server's eta, adam 0.001; refused in another mode",
            RANGE: Range(0, FLOAT32_MAX),
        },
    )
    outer_learning_rate: float = field(
        default=0.0,
        metadata={
            "help": f"{read_by('outer_learning_rate')}: the accumulated update of the local steps is committed "
            "times this (an outer learning rate; with --reply-compression and --compression, GEM with local steps "
            "across slow links); 0: the mode's own (agn 1/lambda, dynsgd and dylu 1); refused in modes gradient "
            "and easgd, which commit no window's update",
            RANGE: Range(0, FLOAT32_MAX),
        },
    )
    batch_delay: float = field(
        default=0.0,
        metadata={
            "help": "seconds this worker waits before each mini-batch: a slower device, for experiments with "
            "workers of unequal speed (dylu)",
            RANGE: Range(0, MAX_SECONDS, unit="seconds"),
        },
    )
    overlap: bool = field(
        default=False,
        metadata={
            "help": "mode gradient: send each commit while the next gradient is computed (one commit in flight; "
            "the gradient is one step staler, which GEM sees): a slow link's round trip off the step's time"
        },
    )
    epochs: int = field(default=1, metadata={"help": "passes over this worker's shard", RANGE: COUNT})
    max_steps: int = field(
        default=0, metadata={"help": "stop after this many commits (0: no limit)", RANGE: COUNT_OR_ZERO}
    )
    max_seconds: float = field(
        default=0.0,
        metadata={
            "help": "stop after training this many seconds, counted from registering (0: no limit): a run that "
            "lasts as long on any machine (the container tutorial's)",
            RANGE: SECONDS_OR_ZERO,
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for this worker's data order", RANGE: Range(0, INT64_MAX)})
    name: str = field(
        default="",
        metadata={"help": "worker name in server logs; a restart under it replaces its dead registration in seconds"},
    )
    job: str = field(
        default="",
        metadata={
            "help": "the job this worker trains (1-64 of [A-Za-z0-9_-], the same for all its workers): a server "
            "holding another job's central variable refuses it ('': the job most of --server's replica list holds, "
            "else the first server's; docs/guides/replicas.md)"
        },
    )
    device: str = field(default="auto", metadata={"help": "torch device: auto (CUDA when present), cpu, cuda"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads for this worker", RANGE: THREADS})
    wire_dtype: str = field(
        default="float32",
        metadata={"help": "how commits and replies travel", "choices": tuple(WIRE_DTYPE_NAMES)},
    )
    compression: str = field(
        default="none",
        metadata={
            "help": "commits in fewer bytes: int8 (a quarter of float32's), int4 (an eighth) or topk (each 256 "
            "values' 16 largest in int8: a 28th), what the codes round away or leave out added to the next "
            "commit (error feedback); none: in --wire-dtype",
            "choices": ("none", *COMPRESSIONS),
        },
    )
    reply_compression: str = field(
        default="none",
        metadata={
            "help": "commit replies that send only what changed: int8 or int4 codes of the difference from the "
            "copy of θ this worker holds (kept in bfloat16 on both ends); none: θ whole in --wire-dtype",
            "choices": ("none", *REPLY_COMPRESSIONS),
        },
    )
    plane: str = field(
        default="auto",
        metadata={
            "help": "how commits and pulls travel: auto (the server's data plane when offered and reachable, "
            "else gRPC), data, grpc",
            "choices": PLANES,
        },
    )
    patience: float = field(
        default=DEFAULT_PATIENCE,
        metadata={
            "help": "seconds the worker goes on retrying a server that does not answer (down, restarting, "
            "failing over) before it gives up with an error; the default outlasts a server's restart",
            RANGE: SECONDS,
        },
    )
    log_every: float = field(
        default=10.0,
        metadata={
            "help": "seconds between progress lines (commits, version, loss, samples/s, staleness); 0: none",
            RANGE: SECONDS_OR_ZERO,
        },
    )
    metrics_port: int = field(default=-1, metadata={"help": "serve this worker's /metrics here (-1: off)"})
    report_file: str = field(default="", metadata={"help": "append one JSON line per commit here"})

    def problems(self) -> list[str]:
        """One line per option outside its range (local steps below one, a NaN learning rate, say),
        and options that do not go together (one the mode does not read: gemps_worker.mode_options)."""
        defaults = {option.name: option.default for option in fields(self)}
        found = out_of_range(self) + unread_options(self.mode, asdict(self), defaults)
        if self.job and not valid_job(self.job):
            found.append(f"job: {self.job[:80]!r} is not a job: 1-{MAX_JOB_LENGTH} characters of [A-Za-z0-9_-]")
        if self.overlap and self.mode != WorkerMode.GRADIENT.value:
            found.append(
                f"overlap: mode {self.mode} commits its local steps' update in one call; only mode gradient overlaps "
                "its commits with the next step"
            )
        return found


@dataclass(frozen=True)
class StepRecord:
    step: int
    version: int
    loss: float
    staleness: int
    scaling_mean: float
    time: float
    scaling_median: float = 1.0
    scaling_at_zero: float = 0.0
    scaling_at_max: float = 0.0
    local_steps: int = 1  # the mini-batches this commit covers


@dataclass
class WorkerSummary:
    steps: int = 0
    final_version: int = 0
    first_losses: list[float] = field(default_factory=list)
    last_losses: list[float] = field(default_factory=list)
    stopped_early: bool = False
    diverged: bool = False


@dataclass
class WorkerHooks:
    """Callbacks for code that runs workers in-process (the experiment runner)."""

    on_registered: Callable[[Registration], None] | None = None
    on_step: Callable[[StepRecord], None] | None = None


class CommitMetrics(Protocol):
    """What run_worker records per commit: served WorkerMetrics, or nothing."""

    def observe_commit(self, duration: float, loss: float, staleness: int) -> None: ...


class _NoMetrics:
    """Metrics off (the default): nothing is recorded, and prometheus_client is never imported,
    which saves every worker about 0.1 s of start-up."""

    def observe_commit(self, duration: float, loss: float, staleness: int) -> None:
        pass


def commit_metrics(port: int) -> CommitMetrics:
    """The worker's /metrics served on `port`, or nothing where `port` is negative."""
    if port < 0:
        return _NoMetrics()
    from gemps_worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    log.info("worker metrics on port %d", metrics.serve(port))
    return metrics


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_worker(
    options: WorkerOptions,
    stop: threading.Event | None = None,
    hooks: WorkerHooks | None = None,
    data: Dataset | None = None,
    metrics: CommitMetrics | None = None,
    *,
    target: Target | None = None,
    retry: RetryPolicy | None = None,
) -> WorkerSummary:
    """Train until the epochs, max_steps or max_seconds are done, `stop` is set, or the loss diverges;
    always leave the server cleanly. `metrics`: served by the caller (default: per
    `options.metrics_port`). `target`: where the server is when it can move (a resolver, see
    gemps.resolver; default `options.server`); `retry`: the client's (default: the SDK's)."""
    problems = options.problems()
    if problems:  # before anything is loaded or registered
        raise ValueError("; ".join(problems))
    stop = stop or threading.Event()
    hooks = hooks or WorkerHooks()
    device = resolve_device(options.device)
    data = data or load_dataset(options.dataset, options.data_dir, options.download)
    model = build_model(options.model, data.input_shape, data.num_classes).to(device)
    train_x = torch.from_numpy(data.train_x).to(device)
    train_y = torch.from_numpy(data.train_y).to(device)
    metrics = metrics or commit_metrics(options.metrics_port)
    summary = WorkerSummary()
    # Line-buffered: observers (the demo) read the lines while the worker trains.
    report = open(options.report_file, "a", buffering=1) if options.report_file else None  # noqa: SIM115
    try:
        with RemoteModel(
            model,
            Client(
                target or options.server,
                name=options.name,
                stop=stop,
                wire_dtype=options.wire_dtype,
                compression=None if options.compression == "none" else options.compression,
                reply_compression=None if options.reply_compression == "none" else options.reply_compression,
                plane=options.plane,
                retry=retry,
                patience=options.patience,
                job=options.job,
            ),
            threads=options.threads,  # --threads is the operator's: set as given, never moved
            overlap=options.overlap,
        ) as remote:
            reg = remote.registration
            mode_name = options.mode
            local = LocalTraining(
                options.agn_steps,
                options.dynsgd_steps,
                options.easgd_alpha,
                options.easgd_period,
                options.local_optimizer,
                options.local_learning_rate,
                options.outer_learning_rate,
                options.dylu_steps,
            )
            mode = create_mode(mode_name, remote, reg.config.learning_rate, local)
            log.info(
                "registered %s: %s rule=%s mode=%s eta=%g batch=%d device=%s",
                reg.worker_id,
                reg.shard.describe(),
                reg.config.rule,
                mode_name,
                reg.config.learning_rate,
                reg.config.batch_size,
                device,
            )
            if hooks.on_registered is not None:
                hooks.on_registered(reg)
            until = time.monotonic() + options.max_seconds if options.max_seconds else math.inf
            progress = WorkerProgress(options.log_every, log)
            started = time.perf_counter()

            def reported(committed: Committed) -> None:
                nonlocal started
                now = time.perf_counter()
                result = committed.result
                metrics.observe_commit(now - started, committed.loss, result.staleness)
                started = now
                summary.steps += 1
                summary.final_version = result.version
                _remember(summary, committed.loss)
                progress.committed(summary.steps, result.version, committed.loss, result.staleness)
                record = StepRecord(
                    summary.steps,
                    result.version,
                    committed.loss,
                    result.staleness,
                    result.scaling_mean,
                    time.time(),
                    result.scaling_median,
                    result.scaling_at_zero,
                    result.scaling_at_max,
                    committed.local_steps,
                )
                if hooks.on_step is not None:
                    hooks.on_step(record)
                if report is not None:
                    report.write(json.dumps(asdict(record)) + "\n")

            def train_batches() -> None:
                """Until the epochs end, a stop, --max-steps commits sent or --max-seconds."""
                for epoch in range(options.epochs):
                    for batch in epoch_batches(len(train_x), reg.shard, reg.config.batch_size, epoch, options.seed):
                        sent = summary.steps + mode.remote.in_flight  # a commit in flight (overlap) is sent
                        over = (options.max_steps and sent >= options.max_steps) or time.monotonic() >= until
                        if stop.is_set() or over:
                            summary.stopped_early = stop.is_set()
                            return
                        index = torch.from_numpy(batch).to(device)

                        def loss_of_batch(index: torch.Tensor = index) -> torch.Tensor:
                            return F.cross_entropy(model(train_x[index]), train_y[index])

                        if options.batch_delay and stop.wait(options.batch_delay):
                            continue  # stopped while waiting: the loop's check returns
                        try:
                            committed = mode.on_batch(loss_of_batch, len(batch))
                        except Diverged as error:
                            log.warning("diverged after %d commits: %s; leaving", summary.steps, error)
                            summary.diverged = True
                            return
                        progress.trained(len(batch))
                        if committed is not None:
                            reported(committed)

            train_batches()
            last = None if summary.diverged else mode.finish()  # the commit still in flight (overlap)
            if last is not None:
                reported(last)
            return summary
    except StoppedError as error:  # SIGTERM while the server was unreachable
        log.warning("%s", error.message)
        summary.stopped_early = True
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
