"""A small transformer classifier under Hugging Face's Trainer learns through gemps as with AdamW
alone (issue 59, item 1; scripts/hf_classifier.py, reduced: 2 epochs, one worker, one seed; the
full runs are in docs/RESULTS.md, "A transformer classifier under the Trainer")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHANCE = 0.10  # ten classes


def test_the_users_adamw_through_local_steps_learns_as_adamw_alone(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    command = [
        sys.executable, str(ROOT / "scripts" / "hf_classifier.py"), "--variants", "alone", "local:1",
        "--workers", "1", "--epochs", "2", "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(out.read_text())["runs"]
    alone, through_gemps = runs["alone"]["mean_accuracy"], runs["local:1"]["mean_accuracy"]
    assert alone > CHANCE + 0.05, result.stdout  # it learns (0.17 after 2 epochs; 0.35 after 8)
    assert abs(through_gemps - alone) <= 0.01, result.stdout  # the bar: within 1 point
    assert "local:1 seed 0: held-out accuracy" in result.stdout


def test_the_workers_trainer_starts_from_the_rate_and_the_warm_up_given_to_them(tmp_path: Path) -> None:
    """`--gemps-learning-rate` is the workers' Trainer's `learning_rate` (the reference keeps 1e-3):
    AdamW's group starts its schedule there; `--gemps-warmup` its warmup_steps, a share of its steps."""
    out = tmp_path / "figures.json"
    command = [
        sys.executable, str(ROOT / "scripts" / "hf_classifier.py"), "--variants", "local:1", "--workers", "2",
        "--epochs", "0.5", "--gemps-learning-rate", "2e-3", "--gemps-warmup", "0.5", "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    written = json.loads(out.read_text())
    workers = written["runs"]["local:1"]["runs"][0]["workers"]
    assert [worker["learning_rate"] for worker in workers] == [2e-3, 2e-3]
    assert written["gemps_learning_rate"] == 2e-3 and written["gemps_warmup"] == 0.5
    assert all(worker["steps"] > 1 and worker["warmup_steps"] == math.ceil(worker["steps"] / 2) for worker in workers)


def test_ddp_takes_its_own_rate_and_warm_up_and_the_trainer_alone_keeps_its_defaults(tmp_path: Path) -> None:
    """`--ddp-learning-rate` and `--ddp-warmup` are the rate and warm-up of DDP's computation (one
    Trainer at N workers' batch), as its AdamW's group and its schedule start from them; the Trainer
    alone, the reference, keeps 1e-3 and no warm-up."""
    out = tmp_path / "figures.json"
    command = [
        sys.executable, str(ROOT / "scripts" / "hf_classifier.py"), "--variants", "alone", "ddp", "--workers", "2",
        "--epochs", "0.5", "--ddp-learning-rate", "3e-3", "--ddp-warmup", "0.5", "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    written = json.loads(out.read_text())
    assert written["ddp_learning_rate"] == 3e-3 and written["ddp_warmup"] == 0.5
    ddp, alone = written["runs"]["ddp"]["runs"][0], written["runs"]["alone"]["runs"][0]
    assert ddp["learning_rate"] == 3e-3 and ddp["steps"] > 1 and ddp["warmup_steps"] == math.ceil(ddp["steps"] / 2)
    assert alone["learning_rate"] == 1e-3 and alone["warmup_steps"] == 0
    assert alone["steps"] == 2 * ddp["steps"]  # batch 32 against 2 x 32: twice the steps for the same samples


@pytest.mark.parametrize(
    ("option", "value", "refusal"),
    [
        ("--gemps-learning-rate", "0", "--gemps-learning-rate is 0"),
        ("--ddp-learning-rate", "-1", "--ddp-learning-rate is -1"),
        ("--ddp-warmup", "-0.5", "--ddp-warmup is -0.5"),
        ("--gemps-warmup", "2.5", "--gemps-warmup is 2.5"),
    ],
)
def test_a_rate_or_a_warm_up_it_cannot_train_with_is_refused_naming_it(option: str, value: str, refusal: str) -> None:
    command = [sys.executable, str(ROOT / "scripts" / "hf_classifier.py"), option, value]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and refusal in result.stderr, result.stderr
