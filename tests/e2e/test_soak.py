"""The soak test's short version: 100 clients against one server for 90 s (scripts/soak.py;
the ten-minute run's results are in docs/RELIABILITY.md). Memory counts after 45 s: the server
returns freed memory to the system, and under this load its RSS climbs for a minute or two
before it levels off (the ten-minute run's per-minute medians show it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The ten-minute run holds 5% (docs/RELIABILITY.md). In 90 s the server's RSS is still
# settling: it follows the requests in flight (±10 MB) and climbs by 5-9% over the first minutes
# on slower machines before levelling off. A leak worth the name (a KiB per commit: 20-40 MB
# between 45 s and 90 s at 500-900 commits/s, 16-30 % of the ~130 MB baseline) still fails this bound.
SHORT_RUN_GROWTH_PCT = 15.0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [
            *(sys.executable, str(ROOT / "scripts" / "soak.py"), "--clients", "100"),
            *("--duration", "90", "--warmup", "0.5", "--max-growth-pct", str(SHORT_RUN_GROWTH_PCT), "--out", str(out)),
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
