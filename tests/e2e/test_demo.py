"""The README's main job, reduced: `gemps demo` end to end in real processes (docs/getting-started.md
walks through it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


@pytest.mark.parametrize("partitions", [1, 2])
def test_demo_trains_and_writes_its_outputs(tmp_path: Path, partitions: int) -> None:
    """The same bar with θ held by one server process and by two (--partitions 2)."""
    out = tmp_path / "demo"
    argv = ["demo", "--workers", "2", "--epochs", "8", "--partitions", str(partitions), "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "gemps_cli", *argv], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(re.search(r"held-out accuracy (\d+\.\d+)%", result.stdout).group(1))  # type: ignore[union-attr]
    # 8 epochs: 95-98% here. 6 gave 94-97% alone but once 89.97% in CI (2 partitions, a loaded machine),
    # and at 4 epochs asynchronous runs spread over 89-92%: too close to the bar.
    assert accuracy >= 90.0, result.stdout
    assert "commits/s" in result.stdout  # live progress was shown
    assert "workers pay)" in result.stdout  # with the server's noise scale (docs/OBSERVABILITY.md)
    # Not on a terminal, the bar prints a line per tenth of the run its looks reach, whatever the
    # host's speed: a line per 5 s showed a fast host's run as its first and last lines, and where
    # the last look had no noise estimate (as near convergence), none showed one.
    tenths = [
        int(version) * 10 // (2 * 8 * 22) for version in re.findall(r"^\[[#.]+\] +\d+% v(\d+)", result.stdout, re.M)
    ]
    assert tenths == sorted(set(tenths)) and tenths[-1] == 10, result.stdout
    with np.load(out / "model.npz", allow_pickle=False) as checkpoint:  # no pickle inside
        assert int(checkpoint["__version__"]) == 2 * 8 * 22
        assert checkpoint["0.weight"].shape == (16, 1, 3, 3)
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (out / "server.log").read_text()
    assert "worker joined" in log
    assert ("gemps.server[partition 1]: worker joined" in log) == (partitions == 2)
