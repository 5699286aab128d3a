"""Liu, Douillard et al. 2024's claim, small: asynchronous Local-SGD with delayed Nesterov and
dynamic local updates (DN+DyLU) comes within a small margin of synchronous Local-SGD at equal
samples. Digits CNN, 4 workers, each over its quarter of the training set for the same epochs:

- sync: synchronous Local-SGD (DiLoCo's outer step), emulated in this process: every worker takes
  H SGD steps from θ, then m ← β·m + mean Δ, θ ← θ + ε·(β·m + mean Δ) (Nesterov on the average);
- dn-dylu: a real `gemps server --rule delayed-nesterov` (same ε, β; N = the 4 workers) and 4
  `gemps worker --mode dylu --dylu-steps H` processes, of unequal speed (--batch-delay);
- async-nesterov: the naive asynchronous baseline: the same workers with H fixed (mode dynsgd),
  and the server's Nesterov applied to every commit (rule nesterov, the update times ε/4).

Only samples that end in a commit count: the asynchronous workers drop a window cut short by
the end of the epochs, the synchronous rounds take every batch (a shorter last round), so the
synchronous baseline sees at least the samples the others do. Results: docs/results/dn_dylu/
and docs/RESULTS.md ("Delayed Nesterov and dynamic local updates (issue 58)").

    .venv/bin/python scripts/dn_dylu_claim.py --seeds 3 --out docs/results/dn_dylu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gemps_proto.schema import Shard
from gemps_worker.cluster import LocalCluster
from gemps_worker.datasets import Dataset, load_digits
from gemps_worker.held_out import evaluate, evaluate_central
from gemps_worker.models import build_model
from gemps_worker.sharding import epoch_batches
from gemps_worker.training import read_report

WORKERS = 4
DELAYS = (0.005, 0.005, 0.015, 0.04)  # seconds before each mini-batch: two fast workers, two slower


@dataclass(frozen=True)
class Setting:
    epochs: int = 12
    local_steps: int = 8  # H
    learning_rate: float = 0.1  # the local SGD steps' eta
    outer_learning_rate: float = 0.7  # epsilon
    momentum: float = 0.9  # beta
    batch_size: int = 32


@dataclass
class Outcome:
    method: str
    seed: int
    accuracy: float
    loss: float
    commits: int
    samples: int  # committed: in windows that ended in a commit
    wall_seconds: float
    local_steps: dict[str, list[int]] = field(default_factory=dict)  # per worker, each commit's window


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def synchronous(data: Dataset, setting: Setting, seed: int) -> Outcome:
    """DiLoCo's synchronous rounds: each worker H SGD steps from θ, the outer Nesterov step on the mean."""
    started = time.monotonic()
    model = build_model("digits-cnn", data.input_shape, data.num_classes)
    x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    theta, velocity = flat(model), torch.zeros_like(flat(model))
    streams = [
        [
            b
            for e in range(setting.epochs)
            for b in epoch_batches(len(x), Shard(k, WORKERS), setting.batch_size, e, seed)
        ]
        for k in range(WORKERS)
    ]
    # Every batch of the epochs, the last round shorter when H does not divide them: the
    # asynchronous workers drop their last window short of H_i, so these are at least theirs.
    rounds = -(-min(len(stream) for stream in streams) // setting.local_steps)
    for r in range(rounds):
        deltas = []
        for stream in streams:
            torch.nn.utils.vector_to_parameters(theta, model.parameters())
            for batch in stream[r * setting.local_steps : (r + 1) * setting.local_steps]:
                index = torch.from_numpy(batch)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[index]), y[index]).backward()  # type: ignore[no-untyped-call]
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-setting.learning_rate)  # type: ignore[arg-type]
            deltas.append(flat(model) - theta)
        mean = torch.stack(deltas).mean(dim=0)
        velocity = setting.momentum * velocity + mean
        theta = theta + setting.outer_learning_rate * (setting.momentum * velocity + mean)
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    loss, accuracy = evaluate(model, data.test_x, data.test_y)
    samples = sum(min(len(stream), rounds * setting.local_steps) for stream in streams) * setting.batch_size
    return Outcome("sync", seed, accuracy, loss, rounds * WORKERS, samples, time.monotonic() - started)


def asynchronous(data: Dataset, setting: Setting, seed: int, method: str, folder: Path) -> Outcome:
    """A real server and 4 `gemps worker` processes: dn-dylu, or async-nesterov (fixed H)."""
    started = time.monotonic()
    training = {"learning_rate": setting.learning_rate, "batch_size": setting.batch_size, "momentum": setting.momentum}
    if method == "dn-dylu":
        server = {"rule": "delayed-nesterov", "dn_learning_rate": setting.outer_learning_rate, **training}
        worker = {"mode": "dylu", "dylu_steps": setting.local_steps}
    else:
        server = {"rule": "nesterov", **training}
        worker = {
            "mode": "dynsgd",
            "dynsgd_steps": setting.local_steps,
            "outer_learning_rate": setting.outer_learning_rate / WORKERS,
        }
    server |= {"num_shards": WORKERS, "metrics_port": -1, "log_level": "warning"}
    folder.mkdir(parents=True, exist_ok=True)
    with LocalCluster(folder, server=server) as cluster:
        for k, delay in enumerate(DELAYS):
            report = folder / f"worker-{k}.jsonl"
            report.unlink(missing_ok=True)
            cluster.start_worker(
                f"worker-{k}", model="digits-cnn", epochs=setting.epochs, seed=seed, batch_delay=delay,
                report_file=str(report), log_every=0, **worker,
            )  # fmt: skip
        codes = cluster.wait_processes(timeout=600)
        if any(codes.values()):
            raise RuntimeError(f"{method}: workers failed {codes}; see {folder}")
        model = build_model("digits-cnn", data.input_shape, data.num_classes)
        measured = evaluate_central(cluster.observer(), model, data)
    assert measured is not None
    version, loss, accuracy = measured
    steps = {f"worker-{k}": [r.local_steps for r in read_report(folder / f"worker-{k}.jsonl")] for k in range(WORKERS)}
    samples = sum(sum(windows) for windows in steps.values()) * setting.batch_size
    return Outcome(method, seed, accuracy, loss, version, samples, time.monotonic() - started, steps)


def summary(outcomes: list[Outcome]) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for method in dict.fromkeys(o.method for o in outcomes):
        mine = [o for o in outcomes if o.method == method]
        for name in ("accuracy", "loss", "samples", "commits", "wall_seconds"):
            values = [float(getattr(o, name)) for o in mine]
            found.setdefault(method, {})[name] = statistics.mean(values)
            found[method][f"{name}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=Setting.epochs)
    parser.add_argument("--out", type=Path, default=Path("docs/results/dn_dylu"))
    parser.add_argument("--runs", type=Path, default=Path("runs/dn_dylu"), help="the clusters' logs and reports")
    args = parser.parse_args()
    setting = Setting(epochs=args.epochs)
    torch.set_num_threads(1)
    data = load_digits()
    outcomes = []
    for seed in range(args.seeds):  # interleaved: a run cut short still compares like with like
        outcomes.append(synchronous(data, setting, seed))
        for method in ("dn-dylu", "async-nesterov"):
            outcomes.append(asynchronous(data, setting, seed, method, args.runs / f"{method}-seed{seed}"))
        for o in outcomes[-3:]:
            print(f"seed {seed} {o.method:15s} acc {100 * o.accuracy:.2f}% loss {o.loss:.4f} samples {o.samples}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "setting": asdict(setting),
        "workers": WORKERS,
        "batch_delays": DELAYS,
        "summary": summary(outcomes),
        "runs": [asdict(o) for o in outcomes],
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    for method, figures in summary(outcomes).items():
        accuracy = f"{100 * figures['accuracy']:.2f} ± {100 * figures['accuracy_sd']:.2f}%"
        loss = f"{figures['loss']:.4f} ± {figures['loss_sd']:.4f}"
        print(f"| {method} | {accuracy} | {loss} | {figures['samples']:.0f} | {figures['commits']:.0f} |")
    for o in outcomes:
        if o.method == "dn-dylu":
            medians = {name: float(np.median(steps)) for name, steps in o.local_steps.items()}
            print(f"seed {o.seed} dn-dylu median local steps per commit: {medians}")


if __name__ == "__main__":
    main()
