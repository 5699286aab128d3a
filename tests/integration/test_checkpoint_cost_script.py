"""scripts/checkpoint_cost.py (docs/PERFORMANCE.md's checkpoint and restart at 100M) at 100K
parameters: real servers, two SDK workers; the figures it records are the run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARAMETERS = 100_000


def test_the_script_records_each_checkpoint_the_final_one_and_the_version_a_restart_restores(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    script = [sys.executable, str(ROOT / "scripts" / "checkpoint_cost.py"), "--params", "100K", "--out", str(out)]
    done = subprocess.run(script, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["stop_exit_code"] == 0
    # every 2W = 4 commits, then the stop's final one after the third round: versions 4 and 6
    assert [written["version"] for written in figures["checkpoints"]] == [4, 6]
    # θ in float32 and the metadata beside it
    assert all(PARAMETERS * 4 < written["bytes"] < PARAMETERS * 4 + (1 << 20) for written in figures["checkpoints"])
    assert figures["restored_version"] == 6
    assert figures["restarted_s"] > 0 and figures["stopped_s"] > 0
