"""Curves and summary figures of experiment runs, aligned on worker steps."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gemps_proto.tensor_codec import COMPRESSIONS, expected_payload_nbytes
from gemps_worker.experiment.single_run import RunResult

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
    # The final central variable on the whole training set (NaN for results from before).
    final_train_loss_full: float = math.nan
    final_train_accuracy_full: float = math.nan
    bytes_moved: float = math.nan  # MB (10^6 bytes) sent and received by all workers: see bytes_moved()
    seed: int = 0
    # When the central variable's held-out accuracy first reached TARGET_ACCURACY (NaN: never):
    # wall-clock seconds, and mini-batches per worker.
    seconds_to_target: float = math.nan
    steps_to_target: float = math.nan


#: the held-out accuracy whose first crossing measures how fast a run converges
TARGET_ACCURACY = 0.95


def mini_batches_per_commit(run: RunResult) -> int:
    c = run.config
    return {"agn": c.agn_steps, "dynsgd": c.dynsgd_steps, "easgd": c.easgd_period}.get(c.mode, 1)


def steps_at_version(run: RunResult, version: int) -> float:
    """Mini-batches per worker behind central version `version` (commits spread evenly over workers)."""
    return version * mini_batches_per_commit(run) / max(run.config.workers, 1)


def first_reaching(run: RunResult, accuracy: float) -> tuple[float, float]:
    """(seconds, mini-batches per worker) when held-out accuracy first reached `accuracy`; NaNs if never."""
    for h in sorted(run.held_out, key=lambda h: h.time):
        if h.accuracy >= accuracy:
            return h.time, steps_at_version(run, h.version)
    return math.nan, math.nan


def bytes_moved(
    commits: int,
    num_parameters: int,
    worker_mode: str,
    compression: str = "none",
    reply_compression: str = "none",
    workers: int = 0,
) -> float:
    """MB (10^6 bytes) the workers moved: each commit sends its payload (4P bytes in float32, its
    codes' bytes with --compression) and receives θ (4P; with --reply-compression its codes' bytes,
    but for each of the `workers`' first reply, θ whole in bfloat16: 2P); the easgd mode also
    pulls θ (4P) before each commit. NaN when P is unknown."""
    if num_parameters <= 0:
        return math.nan

    def coded(codes: str) -> int:
        return 4 * num_parameters if codes == "none" else expected_payload_nbytes(COMPRESSIONS[codes], [num_parameters])

    received = commits * coded(reply_compression)
    if reply_compression != "none":
        received += min(workers, commits) * (2 * num_parameters - coded(reply_compression))
    pulls = commits * 4 * num_parameters if worker_mode == "easgd" else 0
    return (commits * coded(compression) + received + pulls) / 1e6


def summarize(result: RunResult) -> Summary:
    c = result.config
    curve = step_curve(result)
    steps = len(curve.steps)
    tail = max(1, math.ceil(steps * FINAL_FRACTION))
    final_loss = float(np.nanmean(curve.values["loss"][-tail:])) if steps else float("nan")
    settled = [r for r in result.records if r["version"] > WARMUP_FRACTION * result.final_version]
    reached = first_reaching(result, TARGET_ACCURACY)

    def pooled(field: str) -> float:
        """Mean over the settled commits (for scaling_median: the mean of per-commit medians,
        which keeps the trend a median of medians hides once most commits' medians are 0)."""
        values = np.array([r[field] for r in settled], dtype=float)
        return float(np.mean(values)) if values.size else float("nan")

    return Summary(
        name=c.name,
        rule=c.training.rule,
        workers=c.workers,
        learning_rate=c.training.learning_rate,
        kappa=c.kappa,
        mode=c.mode,
        commits=result.final_version,
        worker_steps=steps,
        final_training_loss=final_loss,
        held_out_loss=result.final_loss,
        held_out_accuracy=result.final_accuracy,
        median_pi=pooled("scaling_median"),
        mean_pi=pooled("scaling_mean"),
        fraction_pi_zero=pooled("scaling_at_zero"),
        fraction_pi_max=pooled("scaling_at_max"),
        mean_staleness=pooled("staleness"),
        diverged_workers=result.diverged_workers,
        wall_seconds=result.wall_seconds,
        final_train_loss_full=result.final_train_loss_full,
        final_train_accuracy_full=result.final_train_accuracy_full,
        bytes_moved=bytes_moved(
            result.final_version,
            result.num_parameters,
            c.mode,
            c.compression,
            c.reply_compression,
            c.workers,
        ),
        seed=c.seed,
        seconds_to_target=reached[0],
        steps_to_target=reached[1],
    )


@dataclass(frozen=True)
class Check:
    claim: str
    passed: bool
    detail: str


class Measured(Protocol):
    """What the proxy comparison reads: a run's Summary, or an Aggregate's means over seeds."""

    @property
    def name(self) -> str: ...
    @property
    def final_training_loss(self) -> float: ...
    @property
    def held_out_accuracy(self) -> float: ...


def compare_to_proxy(
    gem: Measured, proxy: Measured, max_loss_ratio: float = 2.0, max_points: float = 2.0, label: str = ""
) -> Check:
    """GEM with n workers vs the one-worker momentum proxy at equal worker steps (`label`, e.g.
    "mean over 3 seeds", goes before the claim)."""
    ratio = gem.final_training_loss / proxy.final_training_loss
    points = 100 * (proxy.held_out_accuracy - gem.held_out_accuracy)
    passed = ratio <= max_loss_ratio and points <= max_points
    prefix = f"{label}: " if label else ""
    return Check(
        f"{prefix}{gem.name}: training loss <= {max_loss_ratio:g}x the momentum proxy's, "
        f"accuracy within {max_points:g} points",
        passed,
        f"loss ratio {ratio:.2f}, accuracy {100 * gem.held_out_accuracy:.2f}% vs {100 * proxy.held_out_accuracy:.2f}%",
    )


# -- repeats of one configuration with other seeds ---------------------------------------------

_SEED_SUFFIX = re.compile(r"-s(\d+)$")


def seeded_name(name: str, seed: int) -> str:
    """Seed 0 keeps the configuration's name (its results stay reusable); seed k >= 1 is NAME-sK."""
    return name if seed == 0 else f"{name}-s{seed}"


def base_name(name: str) -> str:
    """The configuration a run repeats: its name without a trailing -sK."""
    return _SEED_SUFFIX.sub("", name)


# Summary fields given as mean ± sd over seeds (sample sd, ddof=1).
AGGREGATED_FIELDS = (
    "held_out_accuracy",
    "held_out_loss",
    "final_training_loss",
    "final_train_loss_full",
    "final_train_accuracy_full",
    "mean_staleness",
    "commits",
    "bytes_moved",
    "wall_seconds",
    "seconds_to_target",
    "steps_to_target",
)
# Fields that are NaN for runs that never got there: averaged over the runs that did.
REACHED_FIELDS = ("seconds_to_target", "steps_to_target")


@dataclass(frozen=True)
class Aggregate:
    """One configuration over its seeds: the mean and sample standard deviation of each field."""

    name: str  # the base name
    rule: str
    workers: int
    mode: str
    runs: int
    seeds: tuple[int, ...]
    mean: dict[str, float]
    sd: dict[str, float]

    @property
    def final_training_loss(self) -> float:
        return self.mean["final_training_loss"]

    @property
    def held_out_accuracy(self) -> float:
        return self.mean["held_out_accuracy"]


def group_by_config(summaries: Sequence[Summary]) -> dict[str, list[Summary]]:
    """Summaries grouped by base name, in order of first appearance."""
    groups: dict[str, list[Summary]] = {}
    for s in summaries:
        groups.setdefault(base_name(s.name), []).append(s)
    return groups


def aggregate(name: str, group: Sequence[Summary]) -> Aggregate:
    if not group:
        raise ValueError(f"{name}: no runs to aggregate")
    mean: dict[str, float] = {}
    sd: dict[str, float] = {}
    for f in AGGREGATED_FIELDS:
        values = np.array([float(getattr(s, f)) for s in group])
        if f in REACHED_FIELDS:
            values = values[~np.isnan(values)]
            mean[f"{f}_runs"] = float(len(values))
        mean[f] = float(np.mean(values)) if len(values) else math.nan
        sd[f] = float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
    first = group[0]
    return Aggregate(name, first.rule, first.workers, first.mode, len(group), tuple(s.seed for s in group), mean, sd)


def aggregates(summaries: Sequence[Summary], min_runs: int = 2) -> list[Aggregate]:
    """Mean ± sd over seeds for every configuration with at least `min_runs` runs."""
    return [aggregate(name, group) for name, group in group_by_config(summaries).items() if len(group) >= min_runs]
