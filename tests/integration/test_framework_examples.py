"""The framework examples (issue 50): examples/lightning_gemps.py (a LightningModule whose
configure_optimizers returns RemoteOptimizer) and examples/hf_trainer_gemps.py (Hugging Face's Trainer
given RemoteOptimizer and ServerSchedule) train against a real server on a real port: the server's
version advances by their optimizer steps and the held-out loss of the central variable falls.

Each runs as a process of its own, as a user runs it: importing Lightning or transformers takes
seconds and changes process-wide state (warning filters, loggers), which stays out of the suite.
HF_HUB_OFFLINE=1 makes any download an error: the models are built from configs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gemps
from tests.helpers import InProcessServer, scrape
from tests.integration.conftest import StartServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 6


def trains(server: InProcessServer, script: str) -> dict[str, float]:
    """Runs the example on `server` to its end: it printed each step and the held-out loss of the
    central variable at versions 0 and STEPS, lower at the end, and the server is at version STEPS.
    Returns the server's metrics."""
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--server", server.target, "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    steps = re.findall(r"^step (\d+): loss [\d.]+, η [\d.e-]+, version \d+$", completed.stdout, re.MULTILINE)
    assert [int(step) for step in steps] == list(range(1, STEPS + 1)), completed.stdout
    held_out = re.findall(r"^held-out loss ([\d.]+) at version (\d+)$", completed.stdout, re.MULTILINE)
    assert [int(version) for _, version in held_out] == [0, STEPS], completed.stdout
    (before, _), (after, _) = held_out
    assert float(after) < float(before), completed.stdout
    with gemps.Client(server.target) as observer:
        assert observer.status().version == STEPS
    return scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")


def test_the_lightning_example_trains_on_the_server(start_server: StartServer) -> None:
    metrics = trains(start_server(rule="gem", learning_rate=0.5), "lightning_gemps.py")
    assert metrics["gemps_training_samples_total"] == STEPS * 64  # counted from the module's inputs
    assert metrics["gemps_training_loss_count"] == STEPS  # Lightning's closure gives each step's loss


def test_the_hugging_face_trainer_example_trains_on_the_server(start_server: StartServer) -> None:
    server = start_server(rule="gem", learning_rate=0.05)
    metrics = trains(server, "hf_trainer_gemps.py")
    assert metrics["gemps_training_samples_total"] == STEPS * 16
    assert metrics["gemps_training_loss_count"] == STEPS  # the model's output.loss: the Trainer passes none
    with gemps.Client(server.target) as observer:  # the output head tied to the embedding travels once
        assert observer.pull().spec[0].name == "transformer.wte.weight=lm_head.weight"
