"""The speedup runs' analysis: McCandlish's trade-off fitted to them, beside the noise-scale gauge.

For batch B = N*b, steps S (commits per worker) and samples E to the target follow
(S/S_min - 1)(E/E_min - 1) = 1, that is S = S_min (1 + B_crit/B) and E = E_min (1 + B/B_crit) with
B_crit = E_min/S_min. Two free numbers (S_min, B_crit), fitted by least squares on log S and log E
together: B_crit on a fine log grid, S_min in closed form at each. Only configurations every seed
reached the target with are fitted (a run that never reached it has no count).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gemps_worker.experiment.speedup import SpeedupConfig, SpeedupRun, run_all

GRID = np.logspace(-1, 6, 4001)  # B_crit candidates, samples


@dataclass(frozen=True)
class Point:
    """One rule at one N, over its seeds."""

    workers: int
    batch: int  # B = N*b
    runs: int
    reached: int
    steps: float  # mean S over the runs that reached the target
    samples: float  # mean E
    samples_sd: float
    gauge: float  # median of the gauge's B_noise readings during these runs


@dataclass(frozen=True)
class Fit:
    rule: str
    points: tuple[Point, ...]
    steps_min: float  # S_min
    critical_batch: float  # B_crit = E_min/S_min, samples
    gauge: float  # the gauge's B_noise over all this rule's runs (median of their medians)

    @property
    def samples_min(self) -> float:
        return self.steps_min * self.critical_batch

    @property
    def factor(self) -> float:
        """Within what factor the gauge predicts the fitted knee (>= 1; NaN without both)."""
        ratio = self.gauge / self.critical_batch
        return max(ratio, 1 / ratio) if ratio > 0 and math.isfinite(ratio) else math.nan


def finite_median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def points_of(runs: Sequence[SpeedupRun]) -> tuple[Point, ...]:
    points = []
    for workers in sorted({run.workers for run in runs}):
        group = [run for run in runs if run.workers == workers]
        reached = [run for run in group if run.reached]
        samples = [float(run.samples) for run in reached]
        points.append(
            Point(
                workers=workers,
                batch=workers * group[0].batch_size,
                runs=len(group),
                reached=len(reached),
                steps=float(np.mean([run.steps for run in reached])) if reached else math.nan,
                samples=float(np.mean(samples)) if reached else math.nan,
                samples_sd=float(np.std(samples)) if reached else math.nan,
                gauge=finite_median([finite_median(run.noise_scales) for run in group]),
            )
        )
    return tuple(points)


def fit_tradeoff(batches: np.ndarray, steps: np.ndarray, samples: np.ndarray) -> tuple[float, float]:
    """(S_min, B_crit) minimising the squared log errors of S = S_min (1 + B_crit/B) and
    E = S_min B_crit (1 + B/B_crit) over the points."""
    grid = GRID[:, None]
    offsets_s = np.log(steps)[None, :] - np.log1p(grid / batches[None, :])
    offsets_e = np.log(samples)[None, :] - np.log(grid) - np.log1p(batches[None, :] / grid)
    offsets = np.concatenate([offsets_s, offsets_e], axis=1)
    log_s_min = offsets.mean(axis=1, keepdims=True)
    errors = ((offsets - log_s_min) ** 2).sum(axis=1)
    best = int(np.argmin(errors))
    return float(np.exp(log_s_min[best, 0])), float(GRID[best])


def fit_rule(rule: str, runs: Sequence[SpeedupRun]) -> Fit:
    mine = [run for run in runs if run.rule == rule]
    points = points_of(mine)
    fitted = [p for p in points if p.reached == p.runs and p.reached > 0]
    gauge = finite_median([finite_median(run.noise_scales) for run in mine])
    if len(fitted) < 2:
        return Fit(rule, points, math.nan, math.nan, gauge)
    batches = np.array([p.batch for p in fitted], dtype=float)
    steps_min, critical = fit_tradeoff(
        batches, np.array([p.steps for p in fitted]), np.array([p.samples for p in fitted])
    )
    return Fit(rule, points, steps_min, critical, gauge)


def plot(fits: Sequence[Fit], batch_size: int, path: Path) -> None:
    """Samples to target against N per rule (mean ± sd over seeds), the fitted curve, its knee
    (N = B_crit/b, dashed) and the gauge's prediction (N = B_noise/b, dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(fits), figsize=(5 * len(fits), 4), squeeze=False, sharey=True)
    for axis, fit in zip(axes[0], fits, strict=True):
        ns = np.array([p.workers for p in fit.points], dtype=float)
        means = np.array([p.samples for p in fit.points])
        axis.errorbar(ns, means, yerr=[p.samples_sd for p in fit.points], fmt="o", capsize=3, label="measured")
        for p in fit.points:
            if p.reached < p.runs:
                axis.annotate(f"{p.reached}/{p.runs} reached", (p.workers, means[~np.isnan(means)].max()), fontsize=7)
        shown = (0.5, 4 * ns.max())  # a knee outside N's range is named in the legend, not drawn
        if math.isfinite(fit.critical_batch):
            dense = np.logspace(0, math.log10(max(ns.max(), 2)), 100)
            axis.plot(dense, fit.samples_min * (1 + dense * batch_size / fit.critical_batch), label="fit")
            knee = fit.critical_batch / batch_size
            inside = shown[0] <= knee <= shown[1]
            axis.axvline(knee if inside else np.nan, linestyle="--", color="C1", label=f"knee B_crit/b = {knee:.3g}")
        if math.isfinite(fit.gauge):
            axis.axvline(
                fit.gauge / batch_size,
                linestyle=":",
                color="C2",
                label=f"gauge B_noise/b = {fit.gauge / batch_size:.3g}",
            )
        axis.set(xscale="log", yscale="log", xlabel="workers N", title=fit.rule)
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("samples to target")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown(fits: Sequence[Fit], batch_size: int, figure: str, command: str) -> str:
    lines = [
        f"![samples to target against N]({figure})",
        "",
        f"Reproduce: `{command}`",
        "",
        "| rule | N | B = N·b | reached | steps S | samples E (± sd) | gauge B_noise |",
        "|---|---|---|---|---|---|---|",
    ]
    for fit in fits:
        for p in fit.points:
            lines.append(
                f"| {fit.rule} | {p.workers} | {p.batch} | {p.reached}/{p.runs} | {p.steps:.0f} | "
                f"{p.samples:.0f} ± {p.samples_sd:.0f} | {p.gauge:.0f} |"
            )
    lines += ["", "| rule | S_min | E_min | B_crit (fit) | knee N = B_crit/b | gauge B_noise | gauge N | factor |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for fit in fits:
        lines.append(
            f"| {fit.rule} | {fit.steps_min:.0f} | {fit.samples_min:.0f} | {fit.critical_batch:.0f} | "
            f"{fit.critical_batch / batch_size:.1f} | {fit.gauge:.0f} | {fit.gauge / batch_size:.1f} | "
            f"{fit.factor:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run_speedup(config: SpeedupConfig, out: Path, report: Path, markdown_path: Path, force: bool, command: str) -> int:
    """`gemps experiment --suite speedup`: the runs (resumable), then the fit, figure and markdown."""
    runs = run_all(config, out, force)
    fits = [fit_rule(rule, runs) for rule in config.rules]
    figure = report / "speedup.png"
    plot(fits, config.batch_size, figure)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(markdown(fits, config.batch_size, os.path.relpath(figure, markdown_path.parent), command))
    for fit in fits:
        print(
            f"{fit.rule}: B_crit {fit.critical_batch:.0f} samples (knee at "
            f"{fit.critical_batch / config.batch_size:.1f} workers of batch {config.batch_size}); "
            f"gauge B_noise {fit.gauge:.0f}: within a factor {fit.factor:.2f}"
        )
    print(f"wrote {figure} and {markdown_path}")
    return 0
