"""PNG of a training run: worker losses, held-out accuracy, median pi and staleness by version."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gemps_worker.training import StepRecord


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_training(path: Path, workers: Mapping[int, Sequence[StepRecord]], samples: Sequence[Any], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax, pi_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = sorted((r.version, r.loss) for records in workers.values() for r in records)
    if steps:
        versions, losses = (np.array(v) for v in zip(*steps, strict=True))
        loss_ax.plot(versions, losses, ".", alpha=0.15, markersize=3, label="worker mini-batches")
        window = max(1, min(50, len(losses) // 10))
        loss_ax.plot(versions[window - 1 :], moving_average(losses, window), label=f"moving mean ({window})")
    loss_ax.set(title="training loss", xlabel="central version (commits)", ylabel="cross-entropy", yscale="log")
    loss_ax.legend()
    if samples:
        versions = np.array([s.version for s in samples])
        acc_ax.plot(versions, [100 * s.held_out_accuracy for s in samples], "o-", markersize=3)
        pi_ax.plot(versions, [s.median_scaling for s in samples], "o-", markersize=3, label="median pi")
        pi_ax.plot(versions, [s.mean_scaling for s in samples], "^-", markersize=3, label="mean pi")
        pi_ax.plot(versions, [s.mean_staleness for s in samples], "s-", markersize=3, label="mean staleness")
        pi_ax.legend()
    acc_ax.set(title="held-out accuracy", xlabel="central version (commits)", ylabel="%")
    pi_ax.set(title="scaling (per commit, interval means) and staleness", xlabel="central version (commits)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
