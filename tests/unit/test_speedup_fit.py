"""McCandlish's trade-off fitted to the speedup runs (gemps_worker.experiment.speedup_fit)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemps_worker.experiment.speedup import SpeedupRun
from gemps_worker.experiment.speedup_fit import fit_rule, fit_tradeoff, markdown

BATCH = 4


def runs_on_the_curve(steps_min: float, critical: float, seeds: int = 2) -> list[SpeedupRun]:
    """Runs whose counts lie on S = S_min (1 + B_crit/B), E = S_min B_crit (1 + B/B_crit)."""
    runs = []
    for workers in (1, 2, 4, 8, 16, 32, 64):
        batch = workers * BATCH
        steps = steps_min * (1 + critical / batch)
        commits = round(steps * workers)
        for seed in range(seeds):
            runs.append(SpeedupRun("gem", workers, seed, BATCH, True, commits, commits * BATCH, 1.0, [50.0, 70.0]))
    return runs


def test_the_fit_recovers_the_critical_batch_of_exact_counts() -> None:
    batches = np.array([4.0, 8, 16, 32, 64, 128, 256])
    steps = 30 * (1 + 40 / batches)
    steps_min, critical = fit_tradeoff(batches, steps, steps * batches)
    assert steps_min == pytest.approx(30, rel=0.01) and critical == pytest.approx(40, rel=0.01)


def test_a_rule_fit_and_its_factor_against_the_gauge() -> None:
    fit = fit_rule("gem", runs_on_the_curve(30, 40))
    assert fit.critical_batch == pytest.approx(40, rel=0.02)  # commits are whole: the counts round
    assert fit.gauge == 60.0  # the median of the runs' medians
    assert fit.factor == pytest.approx(1.5, rel=0.02)
    assert [p.reached for p in fit.points] == [2] * 7
    assert "| gem | 64 | 256 | 2/2 |" in markdown([fit], BATCH, "speedup.png", "gemps experiment --suite speedup")


def test_configurations_not_every_seed_reached_are_left_out_of_the_fit() -> None:
    runs = runs_on_the_curve(30, 40)
    runs[-1] = SpeedupRun("gem", 64, 1, BATCH, False, 10, 40, 1.0, [math.nan])
    fit = fit_rule("gem", runs)
    assert fit.points[-1].reached == 1 and fit.critical_batch == pytest.approx(40, rel=0.02)
    assert math.isnan(fit_rule("gem", runs[:2]).critical_batch)  # one configuration: nothing to fit
