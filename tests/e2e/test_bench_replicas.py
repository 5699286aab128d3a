"""`gemps bench --replicas 1,2`: a tiny replicas comparison runs and is reported, over loopback
and between simulated hosts.

Checks the harness, not the numbers (those are docs/PERFORMANCE.md's, "Replicas"): both replica
counts measured in every repetition, the primary's and the backup's CPU, a ratio to R = 1 that
is a positive number, and between hosts the journal on the replicas' direct cable. Needs etcd
(and, between hosts, root): without them the test is skipped with one line.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gemps_server.replication.local_etcd import EtcdNotInstalled, find_etcd
from gemps_worker.simulated_hosts import unavailable_reason


def bench(out: Path, *more: str) -> None:
    try:
        find_etcd()
    except EtcdNotInstalled as error:
        pytest.skip(str(error))
    done = subprocess.run(
        [
            *(sys.executable, "-m", "gemps_cli", "bench", "--replicas", "1,2", "--quick", "--sizes", "100K"),
            *("--clients", "2", "--repeats", "2", "--out", str(out), *more),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def check(data: dict[str, Any]) -> None:
    assert not data["skipped"], data["skipped"]
    assert sorted((r["replicas"], r["repeat"]) for r in data["runs"]) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for run in data["runs"]:
        assert run["commits"] > 0 and run["num_parameters"] == 100_000 and run["clients"] == 2, run
        assert run["primary_cpu_ms_per_commit"] > 0, run
        if run["replicas"] == 2:
            assert run["backup_cpu_ms_per_commit"] > 0, run
        else:
            assert run["backup_cpu_ms_per_commit"] is None, run
    single, double = data["summary"]
    assert (single["replicas"], double["replicas"], double["repeats"]) == (1, 2, 2)
    assert math.isfinite(double["vs_single"]) and double["vs_single"] > 0, double
    low, high = double["vs_single_range"]
    assert 0 < low <= double["vs_single"] <= high, double


def test_a_tiny_replicas_bench_over_loopback_measures_both_counts(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    bench(out)
    data = json.loads((out / "replicas-loopback-quick.json").read_text())
    assert data["rate"] is None and data["mode"] == "replicas loopback quick"
    check(data)
    tables = (out / "replicas-loopback-quick.md").read_text()
    assert "## Replicas (over loopback, 2 clients)" in tables and "| 100,000 | 2 | 2 |" in tables


def test_a_tiny_replicas_bench_between_hosts_sends_the_journal_over_the_replicas_cable(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "bench"
    bench(out, "--link", "1gbit")
    data = json.loads((out / "replicas-1gbit-quick.json").read_text())
    check(data)
    for run in data["runs"]:
        assert 0 < run["link_fraction"] <= 1.2, run  # tbf's burst lets a short window pass a little more
        assert run["server_shared_rss_bytes"] == 0, run  # between hosts: the data plane over TCP
        # Each commit's payload (400 KB) crosses the direct cable once per commit, with R = 2 only.
        if run["replicas"] == 2:
            assert run["direct_cable_bytes"] >= run["commits"] * 400_000, run
        else:
            assert run["direct_cable_bytes"] < 1_000_000, run
    assert (
        "## Replicas (between simulated hosts, 1gbit links, 2 clients)" in (out / "replicas-1gbit-quick.md").read_text()
    )


def test_a_tiny_replicas_bench_with_tls_runs_every_process_on_tls(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    bench(out, "--tls")
    data = json.loads((out / "replicas-loopback-tls-quick.json").read_text())
    assert data["tls"] is True and data["mode"] == "replicas loopback tls quick"
    check(data)
    assert "every process on mutual TLS" in (out / "replicas-loopback-tls-quick.md").read_text()
    # The run's certificates, made for it (a server on TLS would have refused a plain client's load).
    security = out / "replicas-loopback-tls-quick.logs" / "security"
    assert sorted(path.name for path in security.glob("*.pem")) == ["ca.pem", "replica.pem"]


def test_a_tiny_failover_bench_kills_the_primary_and_times_the_survivor_taking_over(tmp_path: Path) -> None:
    """`gemps bench --failover --quick`: the worker's commits go on at the survivor after the kill,
    the survivor says it is primary, and the restarted replica comes back as its backup in sync."""
    try:
        find_etcd()
    except EtcdNotInstalled as error:
        pytest.skip(str(error))
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "gemps_cli", "bench", "--failover", "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads((out / "failover.json").read_text())["runs"]
    assert run["num_parameters"] == 100_000
    assert run["promoted_s"] is not None and run["promoted_s"] > 0, run
    assert 0 < run["commit_round_trip_s"] < run["resumed_s"], run  # the commit waited out the failover
    assert run["rejoined_s"] > 0 and run["registered_s"] > 0, run
    assert "| 100,000 |" in (out / "failover.md").read_text()
