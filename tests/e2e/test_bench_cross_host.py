"""`gemps bench --link`: a tiny cross-host bench between simulated hosts runs and is reported.

Checks the harness, not the numbers (those are docs/PERFORMANCE.md's, "Between hosts"): every
cell measured, its share of the links within what a link can carry, and gemps' clients on TCP
(no shared memory reaches across hosts). Needs root: without it the test is skipped with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gemps_bench.capacity import path_of

from gemps_worker.simulated_hosts import unavailable_reason


def test_a_tiny_cross_host_bench_measures_each_cell_and_writes_the_table(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "cross-host"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "gemps_cli", "bench", "--link", "1gbit", "--quick", "--sizes", "100K"),
            *("--clients", "2", "--systems", "echo-tcp,gemps", "--partitions", "1,2", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "cross-host.json").read_text())
    assert not data["skipped"], data["skipped"]
    assert data["link_bytes_per_second"] == 125e6
    assert {(r["system"], r["partitions"]) for r in data["runs"]} == {("echo-tcp", 1), ("gemps", 1), ("gemps", 2)}
    for run in data["runs"]:
        assert run["commits"] > 0 and run["num_parameters"] == 100_000 and run["clients"] == 2, run
        assert 0 < run["link_fraction"] <= 1.2, run  # tbf's burst lets a short window pass a little more
        assert run["payload_bytes_per_second_each_way"] == pytest.approx(run["commits_per_second"] * 400_000)
        if run["system"] == "gemps":
            assert run["server_shared_rss_bytes"] == 0, run  # between hosts: the data plane over TCP
            assert run["client_cpu_ms_per_commit"] > 0 and run["server_cpu_ms_per_commit"] > 0, run
            assert path_of(run) == "gem/float32+tcp", run  # gemps plan projects this cell over TCP
        assert 0 < run["machine_busy_fraction"] <= 1, run
    two = next(r for r in data["runs"] if r["partitions"] == 2)
    assert 0 < two["busiest_partition_cpu_ms_per_commit"] < two["server_cpu_ms_per_commit"], two  # each partition's
    tables = (out / "cross-host.md").read_text()
    assert "## Between hosts (simulated, 1gbit links)" in tables and "| 100,000 | 2 | gemps | 2 |" in tables
