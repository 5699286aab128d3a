"""What the AdamW replay trains (scripts/adam_staleness.py and scripts/adam_rounds.py, which import
it from beside them): the models (`--model`), their optimizers, the text and its held-out loss, and
θ as one vector in and out of a model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gemps_bench.alternatives.workloads import workload
from torch.nn.utils import parameters_to_vector

from gemps.pytorch.values import copy_into
from gemps_worker.held_out import evaluate
from gemps_worker.nanogpt import BATCH, SHAPES, adamw, char_gpt, cosine_schedule, shard_batches
from gemps_worker.text_data import stdlib_text


def _comparison_adam(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)  # gemps_worker.modes' local Adam


class Model(NamedTuple):
    """What the workers train (--model): the model from a seed, its optimizer at a rate, the batch."""

    build: Callable[[int], torch.nn.Module]
    optimizer: Callable[[torch.nn.Module, float], torch.optim.Optimizer]
    batch: int = BATCH


def _user_gpt(seed: int) -> torch.nn.Module:
    return char_gpt(seed, SHAPES["user"])


MODELS = {
    "nanogpt": Model(char_gpt, adamw),
    "user": Model(_user_gpt, adamw, SHAPES["user"].batch),
    "comparison": Model(workload("charlm").build_model, _comparison_adam),
}


def flat(model: torch.nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach()


def load(model: torch.nn.Module, theta: torch.Tensor) -> None:
    """Copy θ into the model's own parameters (vector_to_parameters would make them views of θ)."""
    with torch.no_grad():
        copy_into(list(model.parameters()), theta)


def linear_schedule(
    optimizer: torch.optim.Optimizer, iterations: int, warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The Trainer's default (transformers' get_linear_schedule_with_warmup): a linear warm-up over
    `warmup` steps, then a linear decay to 0 at `iterations`."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (iterations - step) / max(1, iterations - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


#: --schedule: nanoGPT's (warm-up, cosine to a tenth) or the Trainer's (warm-up, linear to 0)
SCHEDULES = {"cosine": cosine_schedule, "linear": linear_schedule}


class Data:
    """The text, and the model the workers train on it (--model), with its optimizer's betas where
    given (--beta1, --beta2) and the decay of its decaying groups (--weight-decay), its schedule's
    shape (--schedule) and a worker's batch where given (--batch: windows a step, instead of the
    model's own)."""

    def __init__(
        self,
        model: str = "nanogpt",
        seed: int = 0,
        beta1: float | None = None,
        beta2: float | None = None,
        schedule: str = "cosine",
        batch: int | None = None,
        weight_decay: float | None = None,
    ) -> None:
        self.train_x, self.train_y, self.test_x, self.test_y = stdlib_text()
        self._build, self._optimizer, own_batch = MODELS[model]
        self.batch = own_batch if batch is None else batch
        self.seed, self.beta1, self.beta2, self._schedule = seed, beta1, beta2, SCHEDULES[schedule]
        self.weight_decay = weight_decay

    def build(self) -> torch.nn.Module:
        return self._build(self.seed)

    def optimizer_of(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        optimizer = self._optimizer(model, lr)
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            group["betas"] = (beta1 if self.beta1 is None else self.beta1, beta2 if self.beta2 is None else self.beta2)
            if self.weight_decay is not None and group["weight_decay"] > 0:  # the groups that decay
                group["weight_decay"] = self.weight_decay
        return optimizer

    def schedule_of(
        self, optimizer: torch.optim.Optimizer, iterations: int, warmup: int | None
    ) -> torch.optim.lr_scheduler.LambdaLR | None:
        """The rate's schedule over `iterations` steps (--schedule), or none (a constant rate) where
        no warm-up is given under the cosine; the linear decays with or without one."""
        if warmup is None and self._schedule is cosine_schedule:
            return None
        return self._schedule(optimizer, iterations, warmup or 0)

    def batches(self, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless mini-batches of rank's shard (the same split for every variant)."""
        return shard_batches(self.train_x, self.train_y, rank, world, self.seed, self.batch)

    def held_out(self, model: torch.nn.Module, theta: torch.Tensor) -> float:
        load(model, theta)
        return round(evaluate(model, self.test_x, self.test_y)[0], 4)


def gradient(
    model: torch.nn.Module, theta: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
) -> list[torch.Tensor]:
    load(model, theta)
    model.zero_grad()
    F.cross_entropy(model(batch[0]), batch[1]).backward()  # type: ignore[no-untyped-call]
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]
