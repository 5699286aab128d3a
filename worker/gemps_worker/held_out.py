"""Held-out loss and accuracy of a model, and of the central variable."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gemps.client import Client
from gemps.errors import GempsError
from gemps.pytorch import load_central
from gemps_worker.datasets import Dataset


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (0..1) over (x, y): per label, so for text ((N, T) targets,
    logits (N, classes, T)) per character, in nats."""
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        inputs = torch.from_numpy(x[start : start + batch_size]).to(device)
        targets = torch.from_numpy(y[start : start + batch_size]).to(device)
        logits = model(inputs)
        total_loss += float(F.cross_entropy(logits, targets, reduction="sum"))
        correct += int((logits.argmax(dim=1) == targets).sum())
    model.train()
    return total_loss / y.size, correct / y.size


def evaluate_central(observer: Client, model: nn.Module, data: Dataset) -> tuple[int, float, float] | None:
    """Pull the newest central variable and measure it on held-out data: (version, loss, accuracy);
    None while the server has no central variable (nobody registered) or cannot be reached."""
    try:
        central = observer.pull()
    except GempsError:
        return None
    load_central(model, central)
    loss, accuracy = evaluate(model, data.test_x, data.test_y)
    return central.version, loss, accuracy
