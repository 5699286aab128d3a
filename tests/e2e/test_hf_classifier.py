"""A small transformer classifier under Hugging Face's Trainer learns through gemps as with AdamW
alone (issue 59, item 1; scripts/hf_classifier.py, reduced: 2 epochs, one worker, one seed; the
full runs are in docs/RESULTS.md, "A transformer classifier under the Trainer")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHANCE = 0.10  # ten classes
SCRIPT = ROOT / "scripts" / "hf_classifier.py"


def classify(tmp_path: Path, *options: str) -> tuple[dict[str, Any], str]:
    """scripts/hf_classifier.py with `options`, run to its end: the figures it wrote, its output."""
    out = tmp_path / "figures.json"
    command = [sys.executable, str(SCRIPT), *options, "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text()), result.stdout


def test_the_users_adamw_through_local_steps_learns_as_adamw_alone(tmp_path: Path) -> None:
    written, said = classify(tmp_path, "--variants", "alone", "local:1", "--workers", "1", "--epochs", "2")
    runs = written["runs"]
    alone, through_gemps = runs["alone"]["mean_accuracy"], runs["local:1"]["mean_accuracy"]
    assert alone > CHANCE + 0.05, said  # it learns (0.17 after 2 epochs; 0.35 after 8)
    assert abs(through_gemps - alone) <= 0.01, said  # the bar: within 1 point
    assert "local:1 seed 0: held-out accuracy" in said


def test_the_workers_trainer_starts_from_the_rate_and_the_warm_up_given_to_them(tmp_path: Path) -> None:
    """`--gemps-learning-rate` is the workers' Trainer's `learning_rate` (the reference keeps 1e-3):
    AdamW's group starts its schedule there; `--gemps-warmup` its warmup_steps, a share of its steps."""
    written, _ = classify(
        tmp_path, "--variants", "local:1", "--workers", "2", "--epochs", "0.5", "--gemps-learning-rate", "2e-3",
        "--gemps-warmup", "0.5",
    )  # fmt: skip
    workers = written["runs"]["local:1"]["runs"][0]["workers"]
    assert [worker["learning_rate"] for worker in workers] == [2e-3, 2e-3]
    assert written["gemps_learning_rate"] == 2e-3 and written["gemps_warmup"] == 0.5
    assert all(worker["steps"] > 1 and worker["warmup_steps"] == math.ceil(worker["steps"] / 2) for worker in workers)


def test_ddp_takes_its_own_rate_and_warm_up_and_the_trainer_alone_keeps_its_defaults(tmp_path: Path) -> None:
    """`--ddp-learning-rate` and `--ddp-warmup` are the rate and warm-up of DDP's computation (one
    Trainer at N workers' batch), as its AdamW's group and its schedule start from them; the Trainer
    alone, the reference, keeps 1e-3 and no warm-up."""
    written, _ = classify(
        tmp_path, "--variants", "alone", "ddp", "--workers", "2", "--epochs", "0.5", "--ddp-learning-rate", "3e-3",
        "--ddp-warmup", "0.5",
    )  # fmt: skip
    assert written["ddp_learning_rate"] == 3e-3 and written["ddp_warmup"] == 0.5
    ddp, alone = written["runs"]["ddp"]["runs"][0], written["runs"]["alone"]["runs"][0]
    assert ddp["learning_rate"] == 3e-3 and ddp["steps"] > 1 and ddp["warmup_steps"] == math.ceil(ddp["steps"] / 2)
    assert alone["learning_rate"] == 1e-3 and alone["warmup_steps"] == 0
    assert alone["steps"] == 2 * ddp["steps"]  # batch 32 against 2 x 32: twice the steps for the same samples


def test_adamw_runs_the_trainers_linear_schedule_on_the_server_over_every_commit(tmp_path: Path) -> None:
    """`adamw:K`: RemoteOptimizer on `--rule adamw --round-size K` with the Trainer's linear
    schedule on the server (warmup-linear), whose length is every commit of the run: the workers'
    steps as their Trainers count them, every one applied."""
    written, _ = classify(
        tmp_path, "--variants", "adamw:1", "--workers", "2", "--epochs", "0.5", "--gemps-learning-rate", "2e-3",
        "--gemps-warmup", "0.25",
    )  # fmt: skip
    (run,) = written["runs"]["adamw:1"]["runs"]
    total = sum(worker["steps"] for worker in run["workers"])
    assert run["server"] == {
        "rule": "adamw", "round_size": 1, "lr_total_commits": total, "lr_warmup_commits": int(0.25 * total),
    }  # fmt: skip
    assert run["version"] == total > 2


def test_windows_run_the_guides_rounds_of_windows_under_the_trainer(tmp_path: Path) -> None:
    """`win:H`: each Trainer's AdamW in LocalSteps(steps=H, planned_steps=its steps) on `--rule adamw
    --outer-rate 1`: a round is every worker's window, so the server's version counts each worker's
    windows (its last one unfinished, committed at close)."""
    written, _ = classify(tmp_path, "--variants", "win:2", "--workers", "2", "--epochs", "0.5")
    (run,) = written["runs"]["win:2"]["runs"]
    assert run["server"] == {"rule": "adamw", "outer_rate": 1.0}
    assert run["version"] == sum(math.ceil(worker["steps"] / 2) for worker in run["workers"]) > 2


@pytest.mark.parametrize(
    ("option", "value", "refusal"),
    [
        ("--gemps-learning-rate", "0", "--gemps-learning-rate is 0"),
        ("--ddp-learning-rate", "-1", "--ddp-learning-rate is -1"),
        ("--ddp-warmup", "-0.5", "--ddp-warmup is -0.5"),
        ("--gemps-warmup", "2.5", "--gemps-warmup is 2.5"),
        ("--variants", "adamw:x", "unknown variant 'adamw:x'"),
        ("--variants", "local:0", "unknown variant 'local:0'"),
        ("--variants", "win:0", "unknown variant 'win:0'"),
    ],
)
def test_a_rate_or_a_warm_up_it_cannot_train_with_is_refused_naming_it(option: str, value: str, refusal: str) -> None:
    command = [sys.executable, str(SCRIPT), option, value]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and refusal in result.stderr, result.stderr
