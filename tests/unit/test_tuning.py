"""The tuning sweep's choices: the gauge's reading, the recipe's worker count, the ranking."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from gemps_proto.schema import TrainingConfig
from gemps_worker.experiment.single_run import HeldOut, RunConfig, RunResult
from gemps_worker.experiment.tuning import (
    PLANS,
    RunSummary,
    gauge_median,
    judge,
    loss_key,
    markdown,
    plan_file,
    recipe_workers,
    run_config,
)
from gemps_worker.experiment.tuning_plot import plot_tuning


def result(readings: list[float]) -> RunResult:
    noise = [(float(i), i, value) for i, value in enumerate(readings)]
    return RunResult(RunConfig("r", 1), [], [HeldOut(0.0, 0, 1.0, 0.5)], 0, 1.0, 0.5, {}, 1.0, noise_scale=noise)


def summary(loss: float, useful: float = 2.0, diverged: int = 0) -> RunSummary:
    return RunSummary("sgd", "r", "momentum", 0.1, 0.9, 1.0, 1, 32, 0, 0, loss, 0.0, 32 * useful, useful, diverged, 1.0)


def test_the_gauge_is_the_median_of_the_second_half_of_its_finite_readings() -> None:
    # The first readings (early training, few windows) are left out; NaN (no estimate) is skipped.
    assert gauge_median(result([1000.0, math.nan, 900.0, 10.0, 20.0, 30.0])) == 20.0
    assert math.isnan(gauge_median(result([math.nan, math.nan])))


def test_the_recipe_takes_the_gauges_workers_rounded_and_at_least_one() -> None:
    assert recipe_workers(summary(1.0, useful=3.7)) == 4
    assert recipe_workers(summary(1.0, useful=0.3)) == 1
    assert recipe_workers(summary(1.0, useful=math.nan)) == 1


def test_diverged_and_non_finite_runs_rank_last() -> None:
    runs = [summary(2.0), summary(1.0, diverged=1), summary(math.nan), summary(2.5)]
    assert min(runs, key=loss_key).held_out_loss == 2.0


def test_every_run_takes_the_plans_steps_per_worker_with_enough_epochs() -> None:
    plan = replace(PLANS["digits"], steps=50)
    config = run_config(plan, "gem-n4", "gem", 0.1, 4, kappa=2.0)
    assert config.max_steps == 50 and config.workers == 4
    options = {"momentum": 0.9, "kappa": 2.0}
    assert config.training == TrainingConfig(rule="gem", learning_rate=0.1, rule_options=options, batch_size=64)
    assert config.epochs * 1438 >= 50 * 64  # the epochs never end a run before its steps


def test_the_recipe_is_judged_against_every_setting_but_the_kappa_probe(tmp_path: Path) -> None:
    runs = [
        replace(summary(2.4), name="momentum-n1"),
        replace(summary(2.2), phase="sweep", rule="gem", name="gem-n4", workers=4),
        replace(summary(2.25), phase="recipe", rule="gem", name="gem-n2", workers=2),
        replace(summary(1.0), phase="kappa", rule="gem", name="gem-n2-kappa2", kappa=2.0),
    ]
    verdict = judge(runs)
    assert verdict["best"] == "gem-n4" and verdict["best_sgd"] == "momentum-n1"
    assert verdict["gap"] == pytest.approx(0.05) and verdict["kappa_probe_loss"] == 1.0
    path = tmp_path / "plan.jsonl"
    path.write_text("".join(json.dumps({"kind": "run", **asdict(r)}) + "\n" for r in runs))
    table = markdown(path)
    assert "| recipe | gem | 0.1 | 1 | 2 |" in table and "gap +0.050" in table


def test_the_plot_draws_every_plan(tmp_path: Path) -> None:
    runs = [
        summary(2.4),
        replace(summary(2.2), phase="sweep", rule="gem", workers=4),
        replace(summary(2.25), phase="recipe", rule="gem", workers=2),
        replace(summary(2.3), phase="kappa", rule="gem", workers=2, kappa=2.0),
        replace(summary(math.nan), phase="sweep", rule="gem", eta=1.0, workers=2),  # diverged: left out
    ]
    path = tmp_path / "plan.jsonl"
    path.write_text("".join(json.dumps({"kind": "run", **asdict(r)}) + "\n" for r in runs))
    out = plot_tuning([path, path], tmp_path / "tuning.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_seed_changes_the_runs_initial_weights_and_data_order_and_their_file() -> None:
    assert run_config(PLANS["lm"], "gem-n2", "gem", 0.1, 2, seed=1).seed == 1
    assert (plan_file("lm", 0), plan_file("lm", 1)) == ("lm.jsonl", "lm-s1.jsonl")
