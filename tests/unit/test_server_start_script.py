"""scripts/server_start.py (docs/PERFORMANCE.md's A/B of a server's start-up), run for real: one start
of this tree is measured and said; a count below one and a folder that is not a checkout are refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "server_start.py"


def run(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120)


def test_a_start_of_this_tree_is_measured() -> None:
    done = run("--starts", "1")
    assert done.returncode == 0, done.stderr
    said = r"this tree: median (\d+\.\d+) s to serving, (\d+\.\d+) s of CPU; CPU of each start \[.*\]\n"
    found = re.fullmatch(said, done.stdout)
    assert found is not None, done.stdout
    assert 0 < float(found.group(1)) < 60 and 0 < float(found.group(2)) < 60


def test_nonsense_is_refused_naming_it(tmp_path: Path) -> None:
    done = run("--starts", "0")
    assert done.returncode == 2 and "--starts must be at least 1, not 0" in done.stderr
    done = run("--old-tree", str(tmp_path))
    assert done.returncode == 2 and f"--old-tree {tmp_path}: not a gemps checkout" in done.stderr
