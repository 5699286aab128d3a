"""The comparison with the alternatives, reduced for CI (issue 58): scenario (a) from a file of the
user's own (its server at 0.35 of a core), gemps-gem and DDP on
the digits CNN, one seed, 14 s each (as many steps on a slower host), through the real command line
on the real rig (CPU quota groups, network namespaces; root only: skipped with one line elsewhere).
Both must reach the lenient CI target and the harness's JSON must hold every metric; the rig must
leave no group or namespace behind."""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from gemps_bench.alternatives.cgroups import CPU_ROOT
from gemps_bench.alternatives.machine import measure
from gemps_bench.alternatives.rig import unavailable_reason

METRICS = {
    "time_to_target_s", "final", "goodput", "samples_computed", "samples_applied", "wire_bytes",
    "bytes_per_sample", "processes", "restarts", "snapshots", "wall_s", "curve", "quotas", "load_average",
}  # fmt: skip
# Seconds of training per cell after the start gate on a host whose step of the digits model takes
# QUIET_STEP_MS (machine.measure): both reach the CI target in 3-7 s there (gemps 3 s, DDP 6 s),
# gemps in 10.5 s beside a loaded suite (load 17); was 20, 25, then 40. The workers' quotas are
# fractions of a core, so on a slower host a cell is as many steps long, not as many seconds: the
# same host's step took 2.9 to 7.4 ms within a day (2026-11-29), where DDP's 6 s became 15.
DURATION_S = 14
QUIET_STEP_MS = 3.0


def alternatives(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gemps_bench.alternatives", *arguments], capture_output=True, text=True, timeout=900
    )


def leftovers() -> set[str]:
    groups = {p.name for p in CPU_ROOT.glob("gemps-alt-*")} if CPU_ROOT.exists() else set()
    netns = Path("/run/netns")
    hosts = (
        {n.name for n in netns.iterdir() if re.fullmatch(r"g\d{5}-(c|w\d|switch)", n.name)} if netns.exists() else set()
    )
    return groups | hosts


def test_gemps_and_ddp_reach_the_ci_target_on_the_rig_and_every_metric_is_written(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    before = leftovers()
    slower = max(1.0, measure("digits")["step_ms"] / QUIET_STEP_MS)  # this host's step against the quiet one's
    duration = round(DURATION_S * slower, 1)
    # Scenario (a) with its server at 0.35 of a core, from a file of the user's own: the cells must run
    # what it says (they looked its name up among the shipped ones once).
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps({"name": "mine", "description": "(a), its server at 0.35 of a core", "coordinator_cpu": 0.35})
    )
    done = alternatives(
        "--scenarios", str(mine), "--systems", "gemps-gem,ddp", "--workload", "digits", "--seeds", "0", "--lr", "0.05",
        "--duration-s", str(duration), "--target", "ci", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path),
        "--snapshot-every", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "digits.json").read_text())
    assert set(data["cells"]) == {"mine/gemps-gem/0", "mine/ddp/0"}
    for key, result in data["cells"].items():
        assert set(result) >= METRICS, key
        reached = result["time_to_target_s"]
        assert reached is not None and reached < duration, (key, duration, result["curve"])
        assert result["final"]["accuracy"] >= 0.8 and result["snapshots"] >= 5
        assert 0.5 < result["goodput"] <= 1.0 and result["samples_applied"] > 0
        assert result["bytes_per_sample"] > 0 and result["restarts"] == 0
        assert result["machine"]["step_ms"] > 0 and result["machine"]["cores"] == os.cpu_count()
        assert result["cell"]["snapshot_every"] == 1.0
        times = [point["t"] for point in result["curve"]]
        assert statistics.median(b - a for a, b in itertools.pairwise(times)) < 1.5, (key, times)  # not the default 2 s
        assert result["quotas"] == {"worker_cpu": 0.2, "coordinator_cpu": 0.35, "workers": 8, "link": "10gbit"}
        assert result["cell"]["scenario_file"] == str(mine)
    assert (tmp_path / "digits.png").stat().st_size > 0 and "| mine | ddp |" in (tmp_path / "digits.md").read_text()
    assert leftovers() == before


def test_a_scenario_that_does_not_exist_is_refused_naming_it(tmp_path: Path) -> None:
    done = alternatives("--scenarios", "zz", "--results", str(tmp_path))
    assert done.returncode == 2
    assert "no scenario 'zz': give a JSON file or one of a, b, c, d, e, f" in done.stderr
    assert not any(tmp_path.iterdir())


def test_a_snapshot_interval_that_is_not_positive_is_refused_naming_it(tmp_path: Path) -> None:
    done = alternatives("--snapshot-every", "0", "--results", str(tmp_path))
    assert done.returncode == 2 and "--snapshot-every must be positive, not 0.0" in done.stderr
    assert not any(tmp_path.iterdir())


def test_a_killed_gemps_worker_is_forked_again_by_its_supervisor_and_commits_again(tmp_path: Path) -> None:
    """Scenario (d)'s first kill (worker 0 at 5 s) on the real rig: the kill spares the worker's
    supervisor, which forks a new worker at once; the rig starts nothing (issue 77, item 11)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    done = alternatives(
        "--scenarios", "d", "--systems", "gemps-gem", "--workload", "digits", "--seeds", "0", "--lr", "0.05",
        "--duration-s", str(DURATION_S), "--target", "ci", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = json.loads((tmp_path / "digits.json").read_text())["cells"].values()
    assert result["restarts"] == 1 and result["processes"] == 9
    (recovery,) = result["recoveries"]
    assert recovery["rank"] == 0 and recovery["applied_s"] is not None, result["recoveries"]
    (run,) = (tmp_path / "runs").iterdir()
    logged = (run / "logs" / "worker-0.log").read_text()
    assert "restarting worker (pid" in logged and "died with signal 9 (SIGKILL)" in logged
    assert [e["action"] for e in json.loads((run / "events.json").read_text())] == ["kill", "restart"]
