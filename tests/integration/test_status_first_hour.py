"""`gemps status` as a new user reads it (issue 60, item 5): the schedule's own settings, never
another schedule's (lr_gamma under cosine), and a checkpoint restored at start, which the server's
log says too (a stack started again over an old checkpoints volume trains on from the old θ)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gemps
from gemps_server.checkpoint_files import load_latest
from tests.helpers import wait_for
from tests.integration.conftest import StartServer

PARAMS = {"w": np.zeros(4, np.float32)}


def status_of(target: str) -> str:
    shown = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "status", "--server", target], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_status_shows_the_schedules_own_settings(start_server: StartServer) -> None:
    cosine = start_server(learning_rate=0.1, lr_schedule="cosine", lr_total_commits=500, lr_min=0.01)
    with gemps.Client(cosine.target) as client:
        client.register(PARAMS)
        shown = status_of(cosine.target)
    assert "learning rate   0.1 now (cosine schedule: lr_total_commits=500 lr_min=0.01)\n" in shown, shown
    assert "lr_gamma" not in shown and "lr_step_size" not in shown, shown
    assert "rule            gem (learning_rate=0.1 kappa=1 momentum=0.9 pi_max=5)\n" in shown, shown
    step = start_server(learning_rate=0.1, lr_schedule="step", lr_step_size=50, lr_gamma=0.5, lr_warmup_commits=10)
    with gemps.Client(step.target) as client:
        client.register(PARAMS)
        shown = status_of(step.target)
    assert "(step schedule: lr_step_size=50 lr_gamma=0.5 lr_warmup_commits=10)\n" in shown, shown
    assert "lr_min" not in shown and "lr_total_commits" not in shown, shown


def test_a_restored_checkpoint_is_logged_at_start_and_shown_by_status(
    tmp_path: Path, start_server: StartServer
) -> None:
    directory = tmp_path / "ckpt"
    first = start_server(checkpoint_dir=directory, checkpoint_every=1, checkpoint_interval=0)
    with gemps.Client(first.target) as client:
        client.register(PARAMS)
        client.commit(np.ones(4, np.float32))
        client.commit(np.ones(4, np.float32))
        job = client.status().job
    wait_for(lambda: (found := load_latest(directory)) is not None and found[1].version == 2, what="checkpoint 2")
    assert "restored" not in status_of(first.target)  # it started without one
    first.stop()
    restarted = start_server(checkpoint_dir=directory, checkpoint_every=1, checkpoint_interval=0)
    found = load_latest(directory)
    assert found is not None
    assert "checkpoint restored" in restarted.log() and "version=2" in restarted.log()
    shown = status_of(restarted.target)
    assert f"\nrestored        version 2 from {found[0]}, when this server started\n" in shown, shown
    assert f"\njob             {job}\n" in shown, shown  # the job's θ, restored: the same job


def test_status_says_the_learning_rate_scales_gradient_commits_only(start_server: StartServer) -> None:
    """Issue 78: under DOWNPOUR an update of +1 at eta 0.05 moved θ by 1 while `gemps status`
    showed the rate as though it applied: every rule takes an update commit unscaled by eta."""
    server = start_server(rule="downpour", learning_rate=0.05)
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        client.commit(np.ones(4, np.float32), kind="update")
        np.testing.assert_array_equal(client.pull().flat, np.ones(4, np.float32))  # moved by 1, not by 0.05
        client.commit(np.ones(4, np.float32))  # a gradient: -0.05 each
        np.testing.assert_allclose(client.pull().flat, np.full(4, 0.95, np.float32))
        shown = status_of(server.target)
    assert (
        "learning rate   0.05 now (constant schedule)\n"
        "                multiplies gradient commits only: an update commit (LocalSteps, a worker's local steps) "
        "reaches rule downpour without it\n"
    ) in shown, shown


@pytest.mark.parametrize(
    "options,says",
    [
        ({}, "AdamW's rate in rule adamw: one step on the mean of each round's commits"),
        (
            {"outer_rate": 0.7},
            "unused: rule adamw takes update commits alone, each round's mean moved by its outer step",
        ),
    ],
    ids=["gradients", "outer-rate"],
)
def test_status_says_what_the_learning_rate_does_under_rounds(
    start_server: StartServer, options: dict[str, float], says: str
) -> None:
    """Under adamw η is AdamW's rate on each round's mean, updates included, or unused when an
    outer rate closes the rounds of updates: the line that says η scales gradients alone is not its."""
    server = start_server(rule="adamw", learning_rate=0.05, **options)
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        shown = status_of(server.target)
    assert f"learning rate   0.05 now (constant schedule)\n                {says}" in shown, shown
