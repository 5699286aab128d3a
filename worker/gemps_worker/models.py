"""Models for the reference worker."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 64), nn.ReLU(), nn.Linear(64, num_classes))


def digits_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small CNN for 1x8x8 digits."""
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (input_shape[1] // 2) * (input_shape[2] // 2), 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {"mlp": mlp, "digits-cnn": digits_cnn}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> nn.Module:
    """Build a model with seeded initial weights (the first worker's become the central variable)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None
    torch.manual_seed(seed)
    return factory(input_shape, num_classes)
