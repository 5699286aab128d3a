"""Curves and summary figures of experiment runs, aligned on worker steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gemps_worker.experiment.runner import RunResult

# "Final" figures average the last this-fraction of worker steps (mini-batch losses are noisy).
FINAL_FRACTION = 0.1
# Commits before every worker's proxy has built up are left out of the pi summaries.
WARMUP_FRACTION = 0.1

CURVE_FIELDS = ("loss", "staleness", "scaling_median", "scaling_mean", "scaling_at_zero", "scaling_at_max")


@dataclass(frozen=True)
class Curve:
    """Means over workers of each field at worker step 1..S (NaN where no worker got there)."""

    steps: np.ndarray
    values: dict[str, np.ndarray]
    workers_at_step: np.ndarray


def step_curve(result: RunResult) -> Curve:
    records = result.records
    if not records:
        return Curve(np.arange(0), {f: np.array([]) for f in CURVE_FIELDS}, np.array([]))
    last = max(r["step"] for r in records)
    sums = {f: np.zeros(last) for f in CURVE_FIELDS}
    counts = np.zeros(last)
    for r in records:
        i = r["step"] - 1
        counts[i] += 1
        for f in CURVE_FIELDS:
            sums[f][i] += r[f]
    with np.errstate(invalid="ignore"):
        values = {f: sums[f] / counts for f in CURVE_FIELDS}
    return Curve(np.arange(1, last + 1), values, counts)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (same length; shorter windows at the start)."""
    if window <= 1 or len(values) == 0:
        return values
    cumulative = np.cumsum(np.insert(np.nan_to_num(values), 0, 0.0))
    out = np.empty_like(values, dtype=float)
    for i in range(len(values)):
        lo = max(0, i + 1 - window)
        out[i] = (cumulative[i + 1] - cumulative[lo]) / (i + 1 - lo)
    return out


@dataclass(frozen=True)
class Summary:
    name: str
    rule: str
    workers: int
    learning_rate: float
    kappa: float
    mode: str
    commits: int
    worker_steps: int
    final_training_loss: float
    held_out_loss: float
    held_out_accuracy: float
    median_pi: float
    mean_pi: float
    fraction_pi_zero: float
    fraction_pi_max: float
    mean_staleness: float
    diverged_workers: int
    wall_seconds: float


def summarize(result: RunResult) -> Summary:
    c = result.config
    curve = step_curve(result)
    steps = len(curve.steps)
    tail = max(1, math.ceil(steps * FINAL_FRACTION))
    final_loss = float(np.nanmean(curve.values["loss"][-tail:])) if steps else float("nan")
    settled = [r for r in result.records if r["version"] > WARMUP_FRACTION * result.final_version]

    def pooled(field: str) -> float:
        """Mean over the settled commits (for scaling_median: the mean of per-commit medians,
        which keeps the trend a median of medians hides once most commits' medians are 0)."""
        values = np.array([r[field] for r in settled], dtype=float)
        return float(np.mean(values)) if values.size else float("nan")

    return Summary(
        c.name,
        c.training.rule,
        c.workers,
        c.training.learning_rate,
        c.training.kappa,
        c.training.worker_mode,
        result.final_version,
        steps,
        final_loss,
        result.final_loss,
        result.final_accuracy,
        pooled("scaling_median"),
        pooled("scaling_mean"),
        pooled("scaling_at_zero"),
        pooled("scaling_at_max"),
        pooled("staleness"),
        result.diverged_workers,
        result.wall_seconds,
    )


@dataclass(frozen=True)
class Check:
    claim: str
    passed: bool
    detail: str


def compare_to_proxy(gem: Summary, proxy: Summary, max_loss_ratio: float = 2.0, max_points: float = 2.0) -> Check:
    """GEM with n workers vs the one-worker momentum proxy at equal worker steps."""
    ratio = gem.final_training_loss / proxy.final_training_loss
    points = 100 * (proxy.held_out_accuracy - gem.held_out_accuracy)
    passed = ratio <= max_loss_ratio and points <= max_points
    return Check(
        f"{gem.name}: training loss <= {max_loss_ratio:g}x the momentum proxy's, accuracy within {max_points:g} points",
        passed,
        f"loss ratio {ratio:.2f}, accuracy {100 * gem.held_out_accuracy:.2f}% vs {100 * proxy.held_out_accuracy:.2f}%",
    )


def by_name(summaries: Sequence[Summary]) -> dict[str, Summary]:
    return {s.name: s for s in summaries}
