"""PNG figures shaped like the GEM paper's Figures 1, 2, 3, 6 and 8, from experiment runs, and
the comparison of GEM with AGN, DynSGD and EASGD (held-out accuracy by time and by worker steps)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gemps_worker.experiment.analysis import mini_batches_per_commit, smooth, step_curve, steps_at_version
from gemps_worker.experiment.single_run import RunResult

SMOOTHING = 9  # worker steps in the moving average of mini-batch losses


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _loss_panel(ax: Any, runs: Sequence[RunResult], proxy: RunResult | None, title: str) -> None:
    colors = _pyplot().cm.viridis(np.linspace(0, 0.9, max(len(runs), 1)))
    for color, run in zip(colors, runs, strict=False):
        curve = step_curve(run)
        label = f"{run.config.workers} workers"
        if run.diverged_workers:
            label += f" ({run.diverged_workers} diverged)"
        ax.plot(curve.steps, smooth(curve.values["loss"], SMOOTHING), color=color, label=label)
    if proxy is not None:
        curve = step_curve(proxy)
        ax.plot(curve.steps, smooth(curve.values["loss"], SMOOTHING), "k--", label="momentum SGD proxy (1 worker)")
    ax.set(title=title, xlabel="worker step", ylabel="training loss (mini-batch, smoothed)", yscale="log")
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def figure_1(path: Path, gem: Sequence[RunResult], proxy: RunResult) -> Path:
    """GEM's training loss stays close to the momentum proxy as workers are added."""
    plt = _pyplot()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    _loss_panel(loss_ax, gem, proxy, "GEM: training loss by worker step")
    for run in [*gem, proxy]:
        steps_per_version = 1.0 / max(run.config.workers, 1)
        versions = np.array([h.version for h in run.held_out])
        acc_ax.plot(
            versions * steps_per_version,
            [100 * h.accuracy for h in run.held_out],
            "k--" if run is proxy else "-",
            label=run.config.name,
        )
    acc_ax.set(title="held-out accuracy", xlabel="worker step (commits / workers)", ylabel="%", ylim=(0, 100))
    acc_ax.legend(fontsize=8)
    return _save(fig, path)


def figure_2(path: Path, downpour: Sequence[RunResult], adaptive: Sequence[RunResult], proxy: RunResult) -> Path:
    """DOWNPOUR degrades as workers grow; adaptive staleness is stable but slow."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    _loss_panel(axes[0], downpour, proxy, "DOWNPOUR")
    _loss_panel(axes[1], adaptive, proxy, "adaptive staleness (1/(tau+1))")
    return _save(fig, path)


def figure_3(path: Path, gem: Sequence[RunResult]) -> Path:
    """GEM's scaling factor pi over time: median and mean fall as workers are added."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(gem), 1)))
    for color, run in zip(colors, gem, strict=False):
        curve = step_curve(run)
        label = f"{run.config.workers} workers"
        axes[0].plot(curve.steps, smooth(curve.values["scaling_median"], SMOOTHING), color=color, label=label)
        axes[1].plot(curve.steps, smooth(curve.values["scaling_mean"], SMOOTHING), color=color, label=label)
        axes[2].plot(
            curve.steps, smooth(curve.values["scaling_at_zero"], SMOOTHING), color=color, label=f"{label}: pi = 0"
        )
        axes[2].plot(
            curve.steps,
            smooth(curve.values["scaling_at_max"], SMOOTHING),
            ":",
            color=color,
            label=f"{label}: pi = pi_max",
        )
    axes[0].set(title="median pi per commit", xlabel="worker step")
    axes[1].set(title="mean pi per commit", xlabel="worker step")
    axes[2].set(title="fraction of parameters clamped", xlabel="worker step", ylim=(0, 1))
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=6, ncol=2)
    return _save(fig, path)


def figure_6(path: Path, pairs: Sequence[tuple[RunResult, RunResult]], proxy: RunResult) -> Path:
    """A misspecified learning rate: DOWNPOUR fails where GEM converges. One panel per worker
    count, each with GEM, DOWNPOUR and the one-worker momentum proxy at the same eta."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(pairs), figsize=(6.5 * len(pairs), 4.5), sharey=True, squeeze=False)
    for ax, (gem, downpour) in zip(axes[0], pairs, strict=True):
        for run, style in ((gem, "-"), (downpour, "-"), (proxy, "k--")):
            curve = step_curve(run)
            label = f"{run.config.training.rule}, {run.config.workers} worker{'s' if run.config.workers > 1 else ''}"
            ax.plot(curve.steps, smooth(curve.values["loss"], SMOOTHING), style, label=label)
        ax.set(
            title=f"eta = {gem.config.training.learning_rate:g}, {gem.config.workers} workers",
            xlabel="worker step",
            ylabel="training loss",
            yscale="log",
        )
        ax.legend(fontsize=8)
    return _save(fig, path)


def figure_8(path: Path, kappas: Sequence[RunResult], proxy: RunResult) -> Path:
    """The proxy amplification kappa trades speed against stability."""
    plt = _pyplot()
    fig, (loss_ax, pi_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run in kappas:
        curve = step_curve(run)
        label = f"kappa = {run.config.kappa:g}"
        loss_ax.plot(curve.steps, smooth(curve.values["loss"], SMOOTHING), label=label)
        pi_ax.plot(curve.steps, smooth(curve.values["scaling_mean"], SMOOTHING), label=label)
    curve = step_curve(proxy)
    loss_ax.plot(curve.steps, smooth(curve.values["loss"], SMOOTHING), "k--", label="momentum proxy")
    loss_ax.set(
        title=f"GEM, {kappas[0].config.workers} workers", xlabel="worker step", ylabel="training loss", yscale="log"
    )
    pi_ax.set(title="mean pi per commit", xlabel="worker step")
    loss_ax.legend(fontsize=8)
    pi_ax.legend(fontsize=8)
    return _save(fig, path)


# Points of the common grid that seeds' held-out curves are interpolated onto.
GRID_POINTS = 200


def held_out_series(run: RunResult, by: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, held-out accuracy in %) of a run, x in wall-clock seconds (by="time") or in
    mini-batches per worker (by="steps": versions / workers x mini-batches per commit)."""
    if by == "time":
        x = np.array([h.time for h in run.held_out], dtype=float)
    else:
        x = np.array([steps_at_version(run, h.version) for h in run.held_out], dtype=float)
    y = np.array([100 * h.accuracy for h in run.held_out], dtype=float)
    order = np.argsort(x, kind="stable")
    return x[order], y[order]


def mean_band(series: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Several seeds' curves on one grid, 0 .. the shortest curve's end: (grid, mean, min, max)."""
    usable = [(x, y) for x, y in series if len(x)]
    if not usable:
        empty = np.array([])
        return empty, empty, empty, empty
    end = min(float(x[-1]) for x, _ in usable)
    grid = np.linspace(0.0, end, GRID_POINTS) if end > 0 else np.array([0.0])
    stacked = np.vstack([np.interp(grid, x, y) for x, y in usable])
    return grid, stacked.mean(axis=0), stacked.min(axis=0), stacked.max(axis=0)


def figure_comparison(path: Path, workers: int, methods: Sequence[tuple[str, Sequence[RunResult]]]) -> Path:
    """Held-out accuracy of each method (its seeds' runs: mean, min-max band) against wall-clock
    seconds and against mini-batches per worker, at one worker count."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, by, xlabel in (
        (axes[0], "time", "wall-clock seconds"),
        (axes[1], "steps", "mini-batches per worker"),
    ):
        for label, runs in methods:
            grid, mean, low, high = mean_band([held_out_series(r, by) for r in runs])
            if not len(grid):
                continue
            name = label if len(runs) == 1 else f"{label} (mean of {len(runs)}, min-max)"
            (line,) = ax.plot(grid, mean, label=name)
            if len(runs) > 1:
                ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.2)
        ax.set(title=f"{workers} workers: held-out accuracy", xlabel=xlabel, ylabel="%", ylim=(0, 100))
        ax.legend(fontsize=8)
    return _save(fig, path)


def figure_modes(path: Path, runs: Sequence[RunResult], proxy: RunResult) -> Path:
    """GEM against DOWNPOUR, adaptive staleness, AGN and asynchronous EASGD at one worker count,
    by mini-batches each worker processed (AGN and EASGD commit once per several)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in [*runs, proxy]:
        curve = step_curve(run)
        style = "k--" if run is proxy else "-"
        label = "momentum proxy (1 worker)" if run is proxy else run.config.name
        ax.plot(curve.steps * mini_batches_per_commit(run), smooth(curve.values["loss"], SMOOTHING), style, label=label)
    ax.set(title="methods compared", xlabel="mini-batches per worker", ylabel="training loss", yscale="log")
    ax.legend(fontsize=8)
    return _save(fig, path)
