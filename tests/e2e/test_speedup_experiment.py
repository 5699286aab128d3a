"""The speedup experiment reduced for CI (`gemps experiment --suite speedup-quick`): real servers,
the SDK, the fit, the figure and the report, in well under a minute."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from gemps_worker.experiment.speedup import load_runs


def test_quick_speedup_experiment_counts_runs_and_reads_the_gauge(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    command = [sys.executable, "-m", "gemps_cli", "experiment", "--suite", "speedup-quick", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = load_runs(out / "runs.jsonl")
    assert [(run.rule, run.workers, run.seed) for run in runs] == [("gem", 1, 0), ("gem", 2, 0), ("gem", 4, 0)]
    for run in runs:
        assert run.reached and run.final_loss <= 1.0 and run.samples == run.commits * run.batch_size
        assert any(math.isfinite(scale) and scale > 0 for scale in run.noise_scales), run.noise_scales
    report = (out / "report" / "SPEEDUP.md").read_text()
    assert "| gem | 4 | 16 | 1/1 |" in report and (out / "report" / "speedup.png").stat().st_size > 0
    assert "gem: B_crit" in result.stdout
