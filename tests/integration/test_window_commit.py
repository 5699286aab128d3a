"""gemps_bench.window_commit (docs/RESULTS.md, "On a GPU"): a LocalSteps window's commit at a model's
size, against a real server; here at 100K parameters, so the harness is what is checked, not the figures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gemps_bench import procfs
from gemps_bench.window_commit import count, cpu_seconds, measure, server_cpu_seconds


def test_it_measures_each_commit_after_the_warm_ones_and_the_cpu_they_took() -> None:
    figures = measure(100_000, commits=3, compression="int8", partitions=2)
    assert figures["parameters"] == 316 * 316  # one square layer of about 100K
    assert len(figures["commit_seconds"]) == 3 and all(s > 0 for s in figures["commit_seconds"])
    # A few commits of 100K may take the worker, or the server, under one clock tick (CI read the
    # worker's as 0.0 once on a loaded host): the readings themselves are checked below, on
    # processes that surely used some.
    assert figures["user_cpu_seconds_a_commit"] >= 0 and figures["system_cpu_seconds_a_commit"] >= 0
    assert figures["server_cpu_seconds_a_commit"] >= 0


def test_the_workers_cpu_is_read_for_this_process() -> None:
    user, system = cpu_seconds()
    assert user > 0 and system >= 0  # this process imported torch: seconds of CPU, many ticks


def test_a_servers_cpu_is_read_for_its_process_and_its_partitions() -> None:
    own = procfs.cpu_seconds(os.getpid())
    assert own is not None and own > 0  # this process imported torch: seconds of CPU, many ticks
    assert server_cpu_seconds(os.getpid()) >= own


@pytest.mark.parametrize(("text", "number"), [("85M", 85_000_000), ("100K", 100_000), ("1.5M", 1_500_000), ("42", 42)])
def test_sizes_read_as_users_write_them(text: str, number: int) -> None:
    assert count(text) == number


def test_no_commits_to_measure_is_refused_by_name() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "gemps_bench.window_commit", "--commits", "0"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "--commits must be at least 1, not 0" in run.stderr


@pytest.mark.parametrize("text", ["0", "85X", "1M,2M"])
def test_a_size_that_is_not_one_count_is_refused_by_name(text: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "gemps_bench.window_commit", "--params", text], capture_output=True, text=True
    )
    assert run.returncode == 2 and "--params" in run.stderr
