"""The comparison's workloads, one definition for every system: model, data shard, batches, held-out metric.

Every system's worker program (gemps' own, DDP's, and the peers' under alternatives/peers/) and
the harness's evaluator import this module, so all of them train the same model on the same shard
of the same data at the same per-worker batch, and are judged on the same held-out set:

- `digits`: the digits CNN (gemps_worker.models.digits_cnn, 38,282 parameters) on scikit-learn's
  8x8 digits (1,437 training images, 360 held out), judged on held-out accuracy;
- `charlm`: a character-level GPT (gemps_worker.models.CharGpt, 6 layers of width 128: 1.2M
  parameters) on the standard library's source (gemps_worker.text_data), judged on held-out loss
  in nats per character.

Pure functions over torch and gemps_worker: nothing here imports gemps_server or a peer's package,
so a peer's own virtualenv can import it with gemps installed in it (pip install -e .[torch]).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gemps.records import Shard
from gemps_worker.datasets import Dataset, load_digits
from gemps_worker.held_out import evaluate
from gemps_worker.models import CharGpt, build_model
from gemps_worker.sharding import epoch_batches
from gemps_worker.text_data import CONTEXT, VOCABULARY, stdlib_text

#: the held-out targets, fixed before any measured run (docs/guides/alternatives.md says how chosen)
TARGETS_FILE = Path(__file__).with_name("targets.json")


@dataclass(frozen=True)
class Workload:
    """One workload: what every system trains, at which per-worker batch, over which learning rates."""

    name: str
    metric: str  # "accuracy" (higher is better) or "loss" (lower is better), on the held-out set
    batch: int  # samples per worker per step, the same for every system
    # the learning-rate search grid of every SGD system (the same size and values; docs: the rule);
    # the Adam-path systems share their own (systems/base.py, ADAMW_LEARNING_RATES)
    learning_rates: tuple[float, ...]

    def data(self) -> Dataset:
        return _dataset(self.name)

    def build_model(self, seed: int = 0) -> nn.Module:
        """The model with seeded initial weights: every system and every rank starts from the same θ0."""
        data = self.data()
        if self.name == "charlm":
            torch.manual_seed(seed)
            return CharGpt(VOCABULARY, CONTEXT, width=128, layers=6, heads=4)
        return build_model("digits-cnn", data.input_shape, data.num_classes, seed=seed)

    def shard(self, rank: int, world: int) -> np.ndarray:
        """Training-sample indices of rank `rank` of `world`: contiguous disjoint slices."""
        _check_rank(rank, world)
        return np.array_split(np.arange(len(self.data().train_x)), world)[rank]

    def batches(self, rank: int, world: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) mini-batches of this rank's shard, epoch after epoch without end, in an
        order seeded by (seed, rank, epoch) (gemps_worker.sharding's, as the reference worker's)."""
        _check_rank(rank, world)
        data = self.data()
        x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
        epoch = 0
        while True:
            for indices in epoch_batches(len(x), Shard(rank, world), self.batch, epoch, seed):
                index = torch.from_numpy(indices)
                yield x[index], y[index]
            epoch += 1

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out {"loss", "accuracy"} (per character for charlm)."""
        data = self.data()
        loss, accuracy = evaluate(model, data.test_x, data.test_y)
        return {"loss": loss, "accuracy": accuracy}

    def reached(self, evaluation: dict[str, float], target: float) -> bool:
        """Whether a held-out evaluation meets `target` on this workload's metric."""
        value = evaluation[self.metric]
        return value >= target if self.metric == "accuracy" else value <= target


def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss of every workload: cross-entropy (per character for charlm)."""
    return F.cross_entropy(model(inputs), targets)


WORKLOADS: dict[str, Workload] = {
    # 0.05 is gemps' shipped eta (TrainingConfig.learning_rate); the grid is it x {1/2, 1, 2}
    "digits": Workload("digits", "accuracy", batch=32, learning_rates=(0.025, 0.05, 0.1)),
    "charlm": Workload("charlm", "loss", batch=16, learning_rates=(0.025, 0.05, 0.1)),
}


def workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None


def targets(path: Path = TARGETS_FILE) -> dict[str, dict[str, float]]:
    """{workload: {"target": held-out value, "ci": the CI run's lenient value, and others by name
    (charlm's "deep": what one AdamW worker on a whole core reaches in 66 s)}} from targets.json."""
    loaded: dict[str, dict[str, float]] = json.loads(path.read_text())
    unknown = sorted(set(loaded) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"{path}: unknown workloads {', '.join(unknown)}")
    return loaded


@functools.cache
def _dataset(name: str) -> Dataset:
    if name == "digits":
        return load_digits()
    if name == "charlm":
        return Dataset("stdlib-text", *stdlib_text(), num_classes=VOCABULARY)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world, world >= 1")
