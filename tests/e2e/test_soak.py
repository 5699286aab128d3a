"""The soak test's short version: 100 clients against one server for 60 s (scripts/soak.py;
the ten-minute run's results are in docs/RELIABILITY.md). Memory counts after 30 s: the server
returns freed memory to the system, and under this load its RSS climbs for a minute or two
before it levels off (the ten-minute run's per-minute medians show it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The ten-minute run holds 5% (docs/RELIABILITY.md). In 60 s the server's RSS is still
# settling: it follows the requests in flight (±10 MB) and climbs by 5-9% over the first minutes
# on slower machines before levelling off (1.1 % in a 60 s run here, 1,077 commits/s). A leak worth
# the name fails this bound: a KiB per commit is 32 MB between 30 s and 60 s at 1,077 commits/s, 26 %
# of the ~125 MB baseline (on a host at half that rate, 13 %: 1.2 KiB a commit fails there). It ran
# 90 s until 2026-11-29: two cores for 30 s more of a suite that must fit 25 minutes.
SHORT_RUN_GROWTH_PCT = 15.0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [
            *(sys.executable, str(ROOT / "scripts" / "soak.py"), "--clients", "100"),
            *("--duration", "60", "--warmup", "0.5", "--max-growth-pct", str(SHORT_RUN_GROWTH_PCT), "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert out.exists(), result.stderr[-4000:]
    soak = json.loads(out.read_text())
    summary = {k: v for k, v in soak.items() if k != "rss_samples"}
    assert soak["errors"] == 0 and soak["server_tracebacks"] == 0, summary
    assert soak["commits_acked"] == soak["server_commits_applied"] >= 100, summary
    assert soak["rss_growth_pct"] < SHORT_RUN_GROWTH_PCT, summary
    assert soak["server_exit_code"] == 0, summary
    assert soak["registrations"] >= 100 and soak["checkpoints_written"] >= 1, summary
    assert soak["passed"] and result.returncode == 0, summary
