"""The soak test's one-minute version: 100 clients against one server (scripts/soak.py; the
ten-minute run's results are in docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_minute_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--clients", "100", "--duration", "60", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.exists(), result.stderr[-4000:]
    soak = json.loads(out.read_text())
    summary = {k: v for k, v in soak.items() if k != "rss_samples"}
    assert soak["errors"] == 0 and soak["server_tracebacks"] == 0, summary
    assert soak["commits_acked"] == soak["server_commits_applied"] >= 100, summary
    assert soak["rss_growth_pct"] < 5.0, summary
    assert soak["server_exit_code"] == 0, summary
    assert soak["registrations"] >= 100 and soak["checkpoints_written"] >= 1, summary
    assert soak["passed"] and result.returncode == 0, summary
