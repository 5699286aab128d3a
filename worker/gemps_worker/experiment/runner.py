"""One experiment run: a real `gemps server` plus pools of worker loops, measured from outside."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemps.client import Client
from gemps_server.process import ServerProcess
from gemps_worker.datasets import Dataset, load_dataset
from gemps_worker.evaluation import evaluate_central
from gemps_worker.experiment.pool import PoolSpec
from gemps_worker.models import build_model
from gemps_worker.training import WorkerOptions

log = logging.getLogger("gemps.experiment")

# Worker loops are spread over this many processes (each one torch, one GIL); 2 suits 2 cores.
MAX_POOLS = 2


@dataclass(frozen=True)
class RunConfig:
    name: str
    rule: str
    workers: int
    learning_rate: float = 0.05
    momentum: float = 0.9
    kappa: float = 1.0
    mode: str = "gradient"
    epochs: int = 10
    model: str = "digits-cnn"
    dataset: str = "digits"
    agn_steps: int = 4
    easgd_alpha: float = 0.5
    easgd_period: int = 4


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

    @property
    def diverged_workers(self) -> int:
        return sum(1 for o in self.outcomes.values() if o == "diverged")

    def save(self, path: Path) -> None:
        payload = asdict(self)
        path.write_text(json.dumps(payload))

    @classmethod
    def load(cls, path: Path) -> RunResult:
        raw = json.loads(path.read_text())
        raw["config"] = RunConfig(**raw["config"])
        raw["held_out"] = [HeldOut(**h) for h in raw["held_out"]]
        return cls(**raw)


def run(config: RunConfig, folder: Path, eval_interval: float = 1.0) -> RunResult:
    folder.mkdir(parents=True, exist_ok=True)
    data = load_dataset(config.dataset)
    model = build_model(config.model, data.input_shape, data.num_classes)
    started = time.monotonic()
    held_out: list[HeldOut] = []
    server_options = {
        "rule": config.rule,
        "learning_rate": config.learning_rate,
        "momentum": config.momentum,
        "kappa": config.kappa,
        "worker_mode": config.mode,
        "max_workers": max(256, config.workers),
        "lease_ttl": 300.0,
        "metrics_port": -1,
        "log_level": "warning",
    }
    with ServerProcess(log_path=folder / "server.log", **server_options) as server:  # type: ignore[arg-type]
        pools = _start_pools(config, server.target, folder)
        with Client(server.target) as observer:
            while any(p.poll() is None for p in pools):
                sample = _evaluate(observer, model, data, started)
                if sample is not None:
                    held_out.append(sample)
                time.sleep(eval_interval)
            final = _evaluate(observer, model, data, started)
        failed = [p.returncode for p in pools if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{config.name}: worker pools failed ({failed}); see {folder}/pool-*.log")
    assert final is not None
    held_out.append(final)
    records, outcomes = _collect(folder)
    result = RunResult(
        config, records, held_out, final.version, final.loss, final.accuracy, outcomes, time.monotonic() - started
    )
    result.save(folder / "result.json")
    return result


def _start_pools(config: RunConfig, target: str, folder: Path) -> list[subprocess.Popen[bytes]]:
    pools = min(MAX_POOLS, config.workers)
    sizes = [config.workers // pools + (1 if i < config.workers % pools else 0) for i in range(pools)]
    options = WorkerOptions(
        server=target,
        dataset=config.dataset,
        model=config.model,
        mode=config.mode,
        epochs=config.epochs,
        agn_steps=config.agn_steps,
        easgd_alpha=config.easgd_alpha,
        easgd_period=config.easgd_period,
    )
    processes, first = [], 0
    for i, size in enumerate(sizes):
        spec = PoolSpec(target, first, size, config.workers, asdict(options), str(folder / f"records-{i}.jsonl"))
        spec_path = folder / f"pool-{i}.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        with open(folder / f"pool-{i}.log", "wb") as log_file:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gemps_worker.experiment.pool", str(spec_path)],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            )
        first += size
    return processes


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
