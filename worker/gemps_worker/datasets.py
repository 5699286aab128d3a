"""Training data: scikit-learn's bundled handwritten digits (offline) and a synthetic set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Held-out fraction and split seed are fixed so every worker and the evaluator agree on the split.
TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: np.ndarray  # float32, (N, C, H, W) images or (N, D) vectors
    train_y: np.ndarray  # int64 class labels
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])


def _split(name: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> Dataset:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = round(len(x) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes)


def load_digits() -> Dataset:
    """1,797 real 8x8 handwritten digits shipped with scikit-learn (no download)."""
    from sklearn.datasets import load_digits as sklearn_digits

    raw = sklearn_digits()
    x = (raw.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return _split("digits", x, raw.target.astype(np.int64), 10)


def load_synthetic(samples: int = 4096, features: int = 32, classes: int = 4, seed: int = 1) -> Dataset:
    """Linearly separable Gaussian blobs: any size, for load tests."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=samples)
    x = centers[y] + rng.normal(size=(samples, features)).astype(np.float32)
    return _split("synthetic", x.astype(np.float32), y.astype(np.int64), classes)


LOADERS: dict[str, Callable[[], Dataset]] = {"digits": load_digits, "synthetic": load_synthetic}


def load_dataset(name: str) -> Dataset:
    try:
        loader = LOADERS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(LOADERS)}") from None
    return loader()
