"""The server flags gemps.pytorch.schedules names for a torch scheduler give that scheduler's learning
rates: torch's after e scheduler.step() calls is the server's η at every version of the e-th run
of K commits (issue 37, item 3). What a RemoteOptimizer user reads: test_torch_schedulers.py."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from gemps_cli.server import parse_config
from torch.optim import lr_scheduler

from gemps.pytorch.schedules import refusal
from gemps_proto.schedules import learning_rate_at
from gemps_proto.schema import TrainingConfig

K = 7  # commits between two scheduler.step() calls
LR = 0.1

MakeScheduler = Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]


def server_training(scheduler: lr_scheduler.LRScheduler) -> TrainingConfig:
    """The training config `gemps server` runs with the flags the refusal names, LR and K filled in."""
    flags = re.search(r"gemps server --learning-rate LR (.*)\n", refusal(scheduler, TrainingConfig()))
    assert flags is not None
    argv = ["--learning-rate", str(LR)]
    for word in flags.group(1).split():
        count = re.fullmatch(r"<(?:(\d+)\*)?K>", word)
        argv.append(str(int(count.group(1) or 1) * K) if count else word)
    return parse_config(argv, environ={}).training


def torch_rates(make: MakeScheduler, epochs: int) -> list[float]:
    """The lr torch's scheduler sets, epoch by epoch (one scheduler.step() each)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    scheduler = make(optimizer)
    rates = []
    for _ in range(epochs):
        rates.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("make", "epochs"),
    [
        pytest.param(lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 12, id="StepLR"),
        pytest.param(lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9), 10, id="ExponentialLR"),
        pytest.param(lambda o: lr_scheduler.MultiStepLR(o, [2, 4, 6], gamma=0.1), 7, id="MultiStepLR"),  # to 6
    ],
)
def test_step_schedules_are_the_same_at_every_commit(make: MakeScheduler, epochs: int) -> None:
    training = server_training(make(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)))
    for epoch, rate in enumerate(torch_rates(make, epochs)):
        for commit in range(K):
            assert learning_rate_at(training, epoch * K + commit) == pytest.approx(rate, rel=1e-12)


def test_cosine_annealing_is_the_same_at_each_scheduler_step() -> None:
    """The server's cosine moves at every commit: it meets torch's at each run's first commit."""

    def make(optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=0.001)

    training = server_training(make(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)))
    for epoch, rate in enumerate(torch_rates(make, 11)):
        assert learning_rate_at(training, epoch * K) == pytest.approx(rate, rel=1e-9)
