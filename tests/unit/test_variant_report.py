"""scripts/variant_report.py (docs/RESULTS.md's tables of a configuration against its variants), run for
real on an experiment's --out folder of result.json files as `gemps experiment` saves them: each
configuration with a variant is compared over its seeds, gaps and ratios included; the others are
left out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemps_worker.experiment.analysis import seeded_name
from gemps_worker.experiment.single_run import HeldOut, RunConfig, RunResult

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "variant_report.py"


def save_run(out: Path, name: str, seed: int, accuracy: float, pi: float, seconds_to_half: float) -> None:
    """A run of 20 commits at mean π `pi` whose held-out accuracy reaches 0.5 `seconds_to_half` after
    its evaluation of the initial θ (at 3 s: start-up) and ends at `accuracy`."""
    config = RunConfig(seeded_name(name, seed), 2, seed=seed)
    records = [
        {"worker": c % 2, "version": c + 1, "scaling_mean": pi, "scaling_at_zero": 0.1, "scaling_at_max": 0.0}
        for c in range(20)
    ]
    held_out = [HeldOut(3.0, 0, 2.3, 0.1), HeldOut(3.0 + seconds_to_half, 10, 1.0, 0.5), HeldOut(30, 20, 0.4, accuracy)]
    outcomes = {"0": "done", "1": "done"}
    result = RunResult(config, records, held_out, 20, 0.4 + seed / 100, accuracy, outcomes, wall_seconds=30.0)
    (out / config.name).mkdir(parents=True)
    result.save(out / config.name / "result.json")


def test_a_configuration_is_compared_with_its_variant_over_seeds(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for seed, accuracy in ((0, 0.90), (1, 0.92)):
        save_run(runs, "gem-n2", seed, accuracy, pi=0.5, seconds_to_half=4.0)
        save_run(runs, "gem-n2-int8", seed, accuracy - 0.01, pi=0.4, seconds_to_half=8.0)
    save_run(runs, "gem-n1", 0, 0.95, pi=1.0, seconds_to_half=1.0)  # no variant: not in the report
    report, table = tmp_path / "report.json", tmp_path / "report.md"
    arguments = [str(runs), "--variant", "int8", "--target-accuracy", "0.5", "--json", str(report)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments, "--markdown", str(table)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(report.read_text())
    assert list(figures) == ["gem-n2"]
    base, variant = figures["gem-n2"]["base"], figures["gem-n2"]["int8"]
    assert (base["seeds"], variant["seeds"]) == (2, 2)
    assert base["held_out_accuracy"] == pytest.approx(91.0)
    assert base["held_out_accuracy_sd"] == pytest.approx(1.414, rel=1e-3)
    assert variant["accuracy_gap_points"] == pytest.approx(-1.0)
    assert variant["pi_median_ratio"] == pytest.approx(0.8) and variant["pi_p90_ratio"] == pytest.approx(0.8)
    assert (base["seconds_to_target"], variant["seconds_to_target"]) == (4.0, 8.0)
    assert base["commits"] == 2 * 18  # the first tenth of each run's commits left out
    lines = table.read_text().splitlines()
    assert lines == done.stdout.strip().splitlines()  # the markdown is the table printed
    assert lines[2] == "| gem-n2 | base | 2 | 91.00 ± 1.41% | 0.4050 | 0.500 | 0.500 | 0.10 | 0.00 | 4.0 |"
    assert lines[4] == "| gem-n2 | int8 - base | | -1.00 points | +0.0000 | x0.800 | x0.800 | | | x0.50 |"
    assert len(lines) == 5
