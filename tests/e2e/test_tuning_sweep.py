"""The tuning sweep reduced for CI (`--plan lm-quick`: the LM, a few commits a run): real servers
and reference workers through every phase, the verdict and the tables."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def test_quick_tuning_sweep_runs_every_phase_and_judges_the_recipe(tmp_path: Path) -> None:
    report = tmp_path / "report"
    module = [sys.executable, "-m", "gemps_worker.experiment.tuning", "--plan", "lm-quick", "--report", str(report)]
    result = subprocess.run(
        [*module, "--out", str(tmp_path / "runs"), "--parallel", "2"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in (report / "lm-quick.jsonl").read_text().splitlines()]
    runs = [line for line in lines if line["kind"] == "run"]
    assert {run["phase"] for run in runs} == {"sgd", "sweep", "recipe", "kappa"}
    for run in runs:  # every worker took the plan's 20 commits: N workers, N times the samples
        assert run["commits"] == 20 * run["workers"] and run["samples"] == run["commits"] * 16, run
        assert math.isfinite(run["held_out_loss"]) and run["held_out_loss"] < 4.6  # below ln(98): it learned
    verdict = lines[-1]
    assert verdict["kind"] == "verdict" and verdict["recipe"]["eta"] == 0.3 and verdict["recipe"]["kappa"] == 1.0
    assert math.isclose(verdict["gap"], verdict["recipe_loss"] - verdict["best_loss"])
    tables = subprocess.run([*module, "--markdown"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| recipe | gem | 0.3 | 1 |" in tables and "gap +" in tables
