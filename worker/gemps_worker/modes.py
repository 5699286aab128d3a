"""How a worker turns mini-batches into commits.

- gradient: commit every mini-batch's gradient; the server applies -eta*g (and GEM's pi).
- agn (Accumulated Gradient Normalization, Hermans et al. 2017): take lambda local SGD steps
  from the central variable, commit the accumulated update divided by lambda.
- easgd (asynchronous elastic averaging SGD, Zhang et al. 2015): keep a local variable x;
  every `period` local steps pull theta, commit e = alpha*(x - theta) and move x <- x - e.

Local SGD steps follow the server's learning-rate schedule: a mode's learning rate (the config's
by default) is scaled by the schedule's factor at the central version the worker last loaded
(gemps_proto.schedules), so they take eta(v) as the server would apply it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gemps.pytorch import RemoteModel
from gemps.records import CommitResult
from gemps_proto.schedules import schedule_factor
from gemps_proto.schema import WorkerMode

#: the modes by name: the ones the protocol defines (TrainingConfig.worker_mode)
MODES = tuple(mode.value for mode in WorkerMode)

LossFunction = Callable[[], torch.Tensor]


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: nothing sensible can be committed."""


@dataclass(frozen=True)
class Committed:
    result: CommitResult
    loss: float  # mean training loss over the mini-batches this commit covers


class TrainingMode(ABC):
    def __init__(self, remote: RemoteModel, learning_rate: float) -> None:
        self.remote = remote
        self.learning_rate = learning_rate  # at factor 1 of the server's schedule

    def local_learning_rate(self) -> float:
        """eta for a local step: the learning rate scaled by the server's schedule at the central
        version last loaded."""
        return self.learning_rate * schedule_factor(self.remote.registration.config, self.remote.version)

    @abstractmethod
    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        """Train on one mini-batch; return what was committed, if this batch ended a commit."""

    def _backward(self, loss_of_batch: LossFunction) -> float:
        self.remote.zero_grad()
        loss = loss_of_batch()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise Diverged(f"training loss is {value}")
        loss.backward()  # type: ignore[no-untyped-call]
        return value

    @torch.no_grad()
    def _local_sgd_step(self) -> None:
        eta = self.local_learning_rate()
        for p in self.remote.model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-eta)


class GradientMode(TrainingMode):
    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        loss = self._backward(loss_of_batch)
        return Committed(self.remote.step(loss=loss, num_samples=batch_size), loss)


class AgnMode(TrainingMode):
    def __init__(self, remote: RemoteModel, learning_rate: float, local_steps: int) -> None:
        super().__init__(remote, learning_rate)
        if local_steps < 1:
            raise ValueError("agn needs at least one local step")
        self.local_steps = local_steps
        self._start: torch.Tensor | None = None
        self._losses: list[float] = []

    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        if self._start is None:
            self._start = self.remote.parameters_vector()
        self._losses.append(self._backward(loss_of_batch))
        self._local_sgd_step()
        if len(self._losses) < self.local_steps:
            return None
        update = (self.remote.parameters_vector() - self._start) / self.local_steps
        loss = sum(self._losses) / len(self._losses)
        self._start, self._losses = None, []
        return Committed(self.remote.commit_update(update, loss=loss), loss)


class EasgdMode(TrainingMode):
    def __init__(self, remote: RemoteModel, learning_rate: float, alpha: float, period: int) -> None:
        super().__init__(remote, learning_rate)
        if not 0 < alpha <= 1 or period < 1:
            raise ValueError("easgd needs 0 < alpha <= 1 and period >= 1")
        self.alpha = alpha
        self.period = period
        self._losses: list[float] = []

    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        self._losses.append(self._backward(loss_of_batch))
        self._local_sgd_step()
        if len(self._losses) < self.period:
            return None
        central = torch.from_numpy(self.remote.client.pull().flat.copy())
        local = self.remote.parameters_vector()
        elastic = self.alpha * (local - central)
        loss = sum(self._losses) / len(self._losses)
        self._losses = []
        result = self.remote.commit_update(elastic, loss=loss, load=False)
        with torch.no_grad():  # x <- x - e: the local variable is pulled toward the center
            device = next(self.remote.model.parameters()).device
            torch.nn.utils.vector_to_parameters((local - elastic).to(device), self.remote.model.parameters())
        return Committed(result, loss)


def create_mode(
    name: str, remote: RemoteModel, learning_rate: float, agn_steps: int, easgd_alpha: float, easgd_period: int
) -> TrainingMode:
    if name == WorkerMode.GRADIENT:
        return GradientMode(remote, learning_rate)
    if name == WorkerMode.AGN:
        return AgnMode(remote, learning_rate, agn_steps)
    if name == WorkerMode.EASGD:
        return EasgdMode(remote, learning_rate, easgd_alpha, easgd_period)
    raise ValueError(f"unknown worker mode {name!r}; choose from {', '.join(MODES)}")
