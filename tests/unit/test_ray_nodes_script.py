"""scripts/ray_nodes.py (docs/RAY.md's 1-node against 3-node figure) run on its recorded runs:
measuring needs a Ray cluster for minutes (the library parts it drives, local_cluster, RemoveNode
and follow_job, are tested in tests/e2e/test_ray_node_loss.py), so the test runs its figures and
its drawing, and holds the figures it prints to the ones recorded beside the runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_draws_its_recorded_runs_again_with_the_figures_recorded_beside_them(tmp_path: Path) -> None:
    recorded = ROOT / "docs" / "results" / "ray-nodes.json"
    figure = tmp_path / "ray-nodes.png"
    script = [
        sys.executable,
        str(ROOT / "scripts" / "ray_nodes.py"),
        "--replot",
        str(recorded),
        "--figure",
        str(figure),
    ]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads(recorded.read_text())
    printed = [json.loads(line.split(": ", 1)[1]) for line in done.stdout.splitlines()]
    assert len(printed) == len(runs) == 4
    for run, figures in zip(runs, printed, strict=True):
        assert figures == pytest.approx(run["figures"]), run["nodes"]
