"""nanoGPT's character recipe, as its train.py writes it, for the Adam-family measurements of
issue 59 (scripts/adam_staleness.py replays it in one process, scripts/adam_workers.py runs it
through a server): the model at nanoGPT's shape scaled down, AdamW with its decay groups and
betas, its warm-up and cosine schedule, and each worker's mini-batches from its own shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gemps_worker.models import CharGpt
from gemps_worker.text_data import CONTEXT, VOCABULARY

BATCH = 16  # windows of CONTEXT characters a step
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.99)  # nanoGPT's shakespeare_char: beta2 0.99 for its small batches
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Shape:
    """A character GPT's size and the batch each worker trains it at."""

    layers: int
    width: int
    heads: int
    batch: int


#: --shape: the project's measurements (0.46M parameters, batch 16), and the user's of issue 78 (nanoGPT
#: scaled to 2 layers of width 128 at batch 32, as a new user tried it from the guide: 0.42M parameters)
SHAPES = {
    "project": Shape(layers=4, width=96, heads=4, batch=BATCH),
    "user": Shape(layers=2, width=128, heads=4, batch=32),
}


def char_gpt(seed: int = 0, shape: Shape = SHAPES["project"]) -> CharGpt:
    """The GPT of `shape` (by default 4 layers, 4 heads, width 96: 0.46M parameters)."""
    torch.manual_seed(seed)
    return CharGpt(VOCABULARY, CONTEXT, width=shape.width, layers=shape.layers, heads=shape.heads)


def decay_groups(model: torch.nn.Module, weight_decay: float = WEIGHT_DECAY) -> list[dict[str, Any]]:
    """configure_optimizers' parameter groups: matrices decay, biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(model: torch.nn.Module, learning_rate: float = LEARNING_RATE, beta1: float = BETAS[0]) -> torch.optim.AdamW:
    """nanoGPT's AdamW: its groups, its betas (`beta1` another β1, β2 its own)."""
    return torch.optim.AdamW(decay_groups(model), lr=learning_rate, betas=(beta1, BETAS[1]))


def cosine_schedule(
    optimizer: torch.optim.Optimizer, iterations: int, warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """get_lr as a factor of the base rate: linear warm-up over `warmup` steps, then a cosine decay
    to a tenth (its min_lr) at `iterations`, flat after."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if step >= iterations:
            return 0.1
        progress = (step - warmup) / max(1, iterations - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def shard_batches(
    inputs: np.ndarray, targets: np.ndarray, rank: int, world: int, seed: int = 0, batch: int = BATCH
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless mini-batches of `batch` windows from `rank`'s shard of a fixed random split (each
    worker's own epochs); `seed` draws another split and order."""
    shard = np.array_split(np.random.default_rng(7 + seed).permutation(len(inputs)), world)[rank]
    rng = np.random.default_rng((1000 + rank, seed) if seed else 1000 + rank)
    while True:
        order = rng.permutation(shard)
        for start in range(0, len(order) - batch + 1, batch):
            index = order[start : start + batch]
            yield torch.from_numpy(inputs[index]), torch.from_numpy(targets[index])
