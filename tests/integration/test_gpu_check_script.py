"""scripts/gpu_check.py (docs/RESULTS.md, overlapped commits on a GPU: re-run it where a GPU is lent),
run for real where there is none (`--device cpu`), a small MLP for a few steps: the waiting worker
commits at staleness 0, the overlapping one at 1, and after each flush the model holds the
server's newest θ bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_the_check_runs_both_workers_and_finds_the_newest_theta(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    sizes = ["--width", "16", "--batch", "32", "--warmup", "2", "--steps", "3", "--rounds", "1"]
    command = [sys.executable, str(SCRIPT), "--device", "cpu", *sizes, "--json", str(out)]
    # One torch thread: a 16-wide MLP has nothing to share out, and starting OpenMP's second one
    # took 0.8 s of CPU here (the steps themselves 0.01 s).
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("the model held the newest θ after every flush"), done.stdout
    figures = json.loads(out.read_text())
    waiting, overlapping = figures["runs"]
    assert (waiting["overlap"], overlapping["overlap"]) == (False, True)
    for run in (waiting, overlapping):
        # 256 -> 16 -> 16 -> 16 -> 10, weights and biases; every step committed once
        assert (run["device"], run["parameters"], run["version"]) == ("cpu", 4826, 5), run
        assert run["model_is_newest_theta"] is True
    # The steps measured (after the 2 of warm-up): waiting, each commit's gradients are of the θ the
    # previous reply loaded; overlapped, of the θ one reply older.
    assert (waiting["staleness"], overlapping["staleness"]) == ([0], [1])
    assert figures["compute_ms"] > 0 and figures["ratio"] > 0
