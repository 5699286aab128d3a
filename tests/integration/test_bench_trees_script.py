"""scripts/bench_trees.py (docs/PERFORMANCE.md's before and after: `gemps bench` on several trees,
alternated in one run), run for real on the working tree at `gemps bench --quick`'s windows: the
run is written as it comes, tagged with its tree and round, and the table gives gemps' figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_trees.py"


def test_the_working_tree_is_benched_and_tabled(tmp_path: Path) -> None:
    runs_file = tmp_path / "runs.json"
    arguments = [".", "--quick", "--sizes", "10K", "--clients", "1", "--systems", "gemps", "--rounds", "1"]
    command = [sys.executable, str(SCRIPT), *arguments, "--trees", str(tmp_path), "--json", str(runs_file)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gemps bench exited" not in done.stdout, done.stdout + done.stderr  # the tree ran
    (run,) = json.loads(runs_file.read_text())
    assert (run["ref"], run["round"], run["system"], run["num_parameters"]) == (".", 0, "gemps", 10_000)
    # The table's row: the run's medians (one run: its own figures), no echo-tcp run to compare with.
    row = re.search(r"^\| \. \| gemps \| 10,000 \| (\S+) \| (\S+) \| (\S+) \| n/a \|$", done.stdout, re.MULTILINE)
    assert row is not None, done.stdout
    server_ms, client_ms, commits_per_second = (float(value) for value in row.groups())
    assert server_ms == round(run["server_cpu_ms_per_commit"], 3) and server_ms > 0
    assert client_ms == round(run["client_cpu_ms_per_commit"], 3) and client_ms > 0
    assert commits_per_second == round(run["commits_per_second"], 1) and commits_per_second > 0


def test_a_ref_that_names_no_commit_is_refused_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "no-such-ref", ".", "--trees", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "'no-such-ref' names no commit" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
