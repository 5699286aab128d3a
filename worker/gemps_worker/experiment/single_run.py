"""One experiment run: a real `gemps server` plus pools of worker loops, measured from outside."""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from gemps.client import Client
from gemps.options import values_of
from gemps.pytorch import RemoteModel
from gemps_proto.rule_options import LEGACY_NAMES, legacy_options
from gemps_proto.schema import TrainingConfig
from gemps_worker.cluster import LocalCluster
from gemps_worker.datasets import Dataset, load_dataset
from gemps_worker.experiment.on_links import LOCAL, ServerPlacement
from gemps_worker.experiment.pool import PoolSpec
from gemps_worker.held_out import evaluate, evaluate_central
from gemps_worker.models import build_model
from gemps_worker.training import WorkerOptions

log = logging.getLogger("gemps.experiment")

# Worker loops are spread over this many processes (each one torch, one GIL); 2 suits 2 cores.
MAX_POOLS = 2
# Seconds a run's server may take to start: 30 s (the cluster's default) was passed on a machine
# loaded some 25-fold (the tuning sweep beside other jobs).
SERVER_STARTUP_TIMEOUT = 120.0
# The final central variable's training loss is measured on at most this many samples (a minute
# of one core for stdlib-text's 67k windows otherwise).
TRAIN_EVALUATION_SAMPLES = 4096


@dataclass(frozen=True)
class RunConfig:
    name: str
    workers: int
    training: TrainingConfig = field(default_factory=TrainingConfig)  # the server's: rule, eta, the rule's options, ...
    epochs: int = 10
    model: str = "digits-cnn"
    dataset: str = "digits"
    agn_steps: int = 4
    easgd_alpha: float = 0.5
    easgd_period: int = 4
    # Repeats of one configuration: worker k's data-order seed is seed * 100_000 + k, and for
    # seed > 0 the initial central variable is built with this seed (seed 0: the workers' own, seed 0).
    seed: int = 0
    dynsgd_steps: int = 10
    local_optimizer: str = "sgd"  # agn, dynsgd, easgd: optimizer of the local steps (sgd, adam)
    local_learning_rate: float = 0.0  # 0: sgd the server's eta, adam 0.001
    outer_learning_rate: float = 0.0  # agn, dynsgd: the accumulated update's factor (0: agn 1/λ, dynsgd 1)
    # Commits per worker, at most (0: the epochs decide). N workers of batch b with max_steps = E/(N b)
    # train on the same E samples whatever N is (the tuning sweep's equal budgets).
    max_steps: int = 0
    gem_state: str = "exact"  # the server's --gem-state: how GEM keeps each worker's m_i and s_i
    compression: str = "none"  # the workers' --compression: how their commits travel (none, int8, int4, topk)
    reply_compression: str = "none"  # the workers' --reply-compression: difference replies (none, int8, int4)
    mode: str = "gradient"  # the workers' --mode: how they turn mini-batches into commits

    @property
    def kappa(self) -> float:
        """GEM's kappa as the run sets it: GEM's default (1) where not set, and 1 (no amplification)
        for rules without one."""
        return self.training.rule_options.get("kappa", 1.0)


@dataclass(frozen=True)
class HeldOut:
    time: float
    version: int
    loss: float
    accuracy: float


@dataclass
class RunResult:
    config: RunConfig
    records: list[dict[str, Any]]  # one per commit: worker, step, version, loss, staleness, scaling_*
    held_out: list[HeldOut]
    final_version: int
    final_loss: float
    final_accuracy: float
    outcomes: dict[str, str]  # worker index -> done | diverged | error: ...
    wall_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    # The final central variable on the whole training set (NaN in results from before they were measured).
    final_train_loss_full: float = math.nan
    final_train_accuracy_full: float = math.nan
    num_parameters: int = 0  # P, the central variable's size (0: unknown)
    # The server's gradient noise scale B_noise in samples (Status.gradient_noise.scale), read at each
    # held-out evaluation: (seconds since start, version, scale); NaN while it has no estimate.
    noise_scale: list[tuple[float, int, float]] = field(default_factory=list)

    @property
    def diverged_workers(self) -> int:
        return sum(1 for o in self.outcomes.values() if o == "diverged")

    def save(self, path: Path) -> None:
        payload = asdict(self)
        path.write_text(json.dumps(payload))

    @classmethod
    def load(cls, path: Path) -> RunResult:
        raw = json.loads(path.read_text())
        raw["config"] = _run_config(raw["config"])
        raw["held_out"] = [HeldOut(**h) for h in raw["held_out"]]
        result = cls(**raw)
        if not result.num_parameters:  # saved before P was recorded
            result.num_parameters = parameter_count(result.config.model, result.config.dataset)
        return result


@functools.cache
def parameter_count(model: str, dataset: str) -> int:
    """P of `model` on `dataset` (0 where the dataset cannot be loaded here)."""
    try:
        data = load_dataset(dataset)
    except Exception as error:  # e.g. IDX files absent and no network
        log.warning("cannot count %s's parameters: %s", model, error)
        return 0
    return _trained_size(build_model(model, data.input_shape, data.num_classes))


def _trained_size(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run(config: RunConfig, folder: Path, eval_interval: float = 1.0, placement: ServerPlacement = LOCAL) -> RunResult:
    """Train `config` with a real server started where `placement` says (on this machine by default;
    across a shaped link: on_links.between_hosts), its results also to FOLDER/result.json."""
    folder.mkdir(parents=True, exist_ok=True)
    data = load_dataset(config.dataset)
    model = build_model(config.model, data.input_shape, data.num_classes, seed=config.seed)
    started = time.monotonic()
    held_out: list[HeldOut] = []
    noise_scale: list[tuple[float, int, float]] = []
    server = {
        **values_of(config.training),
        "max_workers": max(256, config.workers),
        "gem_state": config.gem_state,
        "lease_ttl": 300.0,
        "metrics_port": -1,
        "log_level": "warning",
        "startup_timeout": SERVER_STARTUP_TIMEOUT,
        "host": placement.host,
    }
    with LocalCluster(folder, server=server, server_command=placement.command) as cluster:
        if config.seed:
            _initialise_central(cluster.target, model)
        _start_pools(config, cluster)
        observer = cluster.observer()
        while cluster.running():
            sample = _evaluate(observer, model, data, started)
            if sample is not None:
                held_out.append(sample)
                noise_scale.append((sample.time, sample.version, observer.gradient_noise().scale))
            time.sleep(eval_interval)
        final = _evaluate(observer, model, data, started)
        failed = cluster.failed()
        if failed:
            raise RuntimeError(f"{config.name}: worker pools failed ({failed}); see {folder}/pool-*.log")
    assert final is not None
    held_out.append(final)
    wall_seconds = time.monotonic() - started
    # `model` holds the final central variable (the last _evaluate loaded it). At most
    # TRAIN_EVALUATION_SAMPLES of the training set: all of digits, an evenly spread part of larger sets.
    spread = np.linspace(0, len(data.train_x) - 1, min(len(data.train_x), TRAIN_EVALUATION_SAMPLES)).astype(int)
    train_loss, train_accuracy = evaluate(model, data.train_x[spread], data.train_y[spread])
    records, outcomes = _collect(folder)
    result = RunResult(
        config,
        records,
        held_out,
        final.version,
        final.loss,
        final.accuracy,
        outcomes,
        wall_seconds,
        final_train_loss_full=train_loss,
        final_train_accuracy_full=train_accuracy,
        num_parameters=_trained_size(model),
        noise_scale=noise_scale,
    )
    result.save(folder / "result.json")
    return result


def _start_pools(config: RunConfig, cluster: LocalCluster) -> None:
    pools = min(MAX_POOLS, config.workers)
    sizes = [config.workers // pools + (1 if i < config.workers % pools else 0) for i in range(pools)]
    options = WorkerOptions(
        server=cluster.target,
        dataset=config.dataset,
        model=config.model,
        mode=config.mode,
        epochs=config.epochs,
        agn_steps=config.agn_steps,
        easgd_alpha=config.easgd_alpha,
        easgd_period=config.easgd_period,
        dynsgd_steps=config.dynsgd_steps,
        local_optimizer=config.local_optimizer,
        local_learning_rate=config.local_learning_rate,
        outer_learning_rate=config.outer_learning_rate,
        max_steps=config.max_steps,
        compression=config.compression,
        reply_compression=config.reply_compression,
    )
    first = 0
    for i, size in enumerate(sizes):
        spec = PoolSpec(
            cluster.target,
            first,
            size,
            config.workers,
            asdict(options),
            str(cluster.folder / f"records-{i}.jsonl"),
            seed=config.seed,
        )
        spec_path = cluster.folder / f"pool-{i}.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        cluster.start_process(f"pool-{i}", [sys.executable, "-m", "gemps_worker.experiment.pool", str(spec_path)])
        first += size


def _initialise_central(target: str, model: Any) -> None:
    """Make `model`'s weights the central variable: register them first, then leave at once
    (the server keeps θ; the workers that register next receive it instead of their own)."""
    with RemoteModel(model, target, name="initialiser"):
        pass


def _run_config(raw: dict[str, Any]) -> RunConfig:
    """A RunConfig from result.json (also from before the training config was its own field, from
    before seed, dynsgd_steps and the local optimizer: their defaults, and from before rule options
    and the worker mode left the training config: its worker_mode, momentum, kappa and pi_max)."""
    raw = dict(raw)
    training = raw.pop("training", None)
    if training is None:  # the older, flat layout: training fields beside the others ("mode" is the run's)
        names = {f.name for f in fields(TrainingConfig)} | set(LEGACY_NAMES)
        training = {name: raw.pop(name) for name in names if name in raw}
    training = dict(training)
    if "worker_mode" in training:
        raw["mode"] = training.pop("worker_mode")
    legacy = {name: training.pop(name) for name in LEGACY_NAMES if name in training}
    if "rule_options" not in training:
        training["rule_options"] = legacy_options(training.get("rule", TrainingConfig().rule), legacy)
    return RunConfig(training=TrainingConfig(**training), **raw)


def _evaluate(observer: Client, model: Any, data: Dataset, started: float) -> HeldOut | None:
    measured = evaluate_central(observer, model, data)
    return None if measured is None else HeldOut(time.monotonic() - started, *measured)


def _collect(folder: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    records: list[dict[str, Any]] = []
    outcomes: dict[str, str] = {}
    for path in sorted(folder.glob("records-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        outcome_file = Path(str(path) + ".outcomes")
        if outcome_file.exists():
            outcomes.update(json.loads(outcome_file.read_text()))
    records.sort(key=lambda r: r["version"])
    return records, outcomes
