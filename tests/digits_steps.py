"""A linear model on digits and a seeded loop of mini-batch steps through any torch optimizer: the
overlap and local-steps tests' (tests/integration/test_overlapped_commits.py, test_local_steps.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from gemps.pytorch import LocalSteps, RemoteOptimizer


def linear() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


def layer_of(model: torch.nn.Sequential) -> torch.nn.Linear:
    found = model[1]
    assert isinstance(found, torch.nn.Linear)
    return found


def train_steps(
    model: torch.nn.Module,
    optimizer: RemoteOptimizer | LocalSteps,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    after_step: Callable[[], object] = lambda: None,
) -> None:
    """`steps` steps on mini-batches of 64 drawn with seed 0; `optimizer.step(loss=...)` each."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = torch.from_numpy(rng.choice(len(x), size=64, replace=False))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step(loss=loss)
        after_step()
