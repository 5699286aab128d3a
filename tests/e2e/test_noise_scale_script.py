"""scripts/noise_scale.py (issue 78): the simple noise scale B = tr(Σ)/|G|² along one AdamW worker's
run. Its estimator is held to a case whose G and Σ are known; each job runs as the records ran
it, reduced to a few steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.script_modules import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "noise_scale.py"


class Mean(torch.nn.Module):
    """loss(x) = w · mean_i x_i: a batch's gradient is its samples' mean, whatever w."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.w @ batch.mean(dim=0)


def _mean_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = model(batch)
    return result


def test_the_estimate_is_the_noise_scale_of_samples_whose_mean_and_spread_are_known() -> None:
    """Samples G + s·z in d dimensions (G 0.5 everywhere): |G|² = d/4 and tr(Σ) = d·s², so B = 4·s² samples."""
    script = load_script(SCRIPT, "noise_scale")
    size, batch, sigma = 400, 8, 2.0
    generator = torch.Generator().manual_seed(0)
    mean = torch.full((size,), 0.5)
    batches = [mean + sigma * torch.randn(batch, size, generator=generator) for _ in range(64)]
    measured = script.noise_scale(Mean(size), _mean_loss, batches, batch)
    expected = 4 * sigma**2  # 16 samples: twice the batch
    assert abs(measured["signal"] / (size * 0.25) - 1) < 0.1
    assert abs(measured["trace"] / (size * sigma**2) - 1) < 0.05
    assert abs(measured["noise_scale"] / expected - 1) < 0.15
    assert measured["per_batch"] == measured["noise_scale"] / batch


def test_batches_that_disagree_wholly_have_no_signal_and_an_unbounded_noise_scale() -> None:
    """Two batches whose gradients cancel: the mean is 0, |G|² comes out negative, B is infinite."""
    script = load_script(SCRIPT, "noise_scale")
    direction = torch.linspace(-1, 1, 50)
    batches = [direction.expand(4, 50), -direction.expand(4, 50)]
    measured = script.noise_scale(Mean(50), _mean_loss, batches, 4)
    assert measured["signal"] < 0
    assert measured["noise_scale"] == measured["per_batch"] == float("inf")
    assert script._finite(measured)["noise_scale"] is None  # JSON has no infinity: the record says null


def _run(tmp_path: Path, *arguments: str) -> dict[str, Any]:
    record = tmp_path / "noise.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments, "--points", "2", "--probes", "3", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(record.read_text()))


def test_each_job_is_measured_at_its_points_along_one_workers_run(tmp_path: Path) -> None:
    gpt = _run(tmp_path, "--job", "gpt", "--samples", "256", "--batch", "4", "--warmup", "4")
    assert gpt["settings"]["batch"] == 4 and gpt["settings"]["job"] == "gpt"
    points = gpt["runs"]["0"]
    assert [point["step"] for point in points] == [32, 64] and [point["samples"] for point in points] == [128, 256]
    assert all(point["trace"] > 0 and point["held_out_loss"] > 0 for point in points)
    classifier = _run(tmp_path, "--job", "classifier", "--epochs", "0.25", "--seeds", "0", "1")
    assert set(classifier["runs"]) == {"0", "1"}
    for points in classifier["runs"].values():
        assert [point["step"] for point in points] == [5, 11]  # 11 steps of 32 in a quarter of 1,438 digits
        assert all(point["trace"] > 0 and 0 <= point["accuracy"] <= 1 for point in points)


def test_with_gauge_the_servers_estimate_from_local_steps_sums_is_read_at_each_point(tmp_path: Path) -> None:
    """--gauge: the GPT's AdamW steps through LocalSteps to a real `gemps server`, whose gauge its
    gradient sums feed (a window of 8 local steps each): read beside the probe at each point."""
    gpt = _run(tmp_path, "--job", "gpt", "--samples", "384", "--batch", "4", "--warmup", "4", "--gauge")
    points = gpt["runs"]["0"]
    assert [point["step"] for point in points] == [48, 96]
    assert [point["gauge_windows"] for point in points] == [6, 12]  # every 8th step's commit carried sums
    assert points[0]["gauge_per_batch"] is None  # fewer than 10 windows: no estimate yet (NaN, null in JSON)
    assert all(point["trace"] > 0 for point in points)
