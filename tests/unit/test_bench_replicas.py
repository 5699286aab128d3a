"""`gemps bench --replicas`: its plan, the figures each run gets, the medians and ratios over the
repetitions, and the table (gemps_bench.replicas, gemps_bench.report), without servers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from gemps_bench.main import replicas_path
from gemps_bench.replica_figures import replica_figures, summarize
from gemps_bench.replicas import ReplicasSpec
from gemps_bench.report import replicas_table
from gemps_bench.results import LoadResult


def run(size: int, replicas: int, repeat: int, rate: float, primary: float = 1.0, **more: Any) -> dict[str, Any]:
    return {
        "num_parameters": size,
        "replicas": replicas,
        "repeat": repeat,
        "commits_per_second": rate,
        "primary_cpu_ms_per_commit": primary,
        "backup_cpu_ms_per_commit": None if replicas == 1 else 0.5,
        "client_cpu_ms_per_commit": 2.0,
        "latency_p50_ms": 10.0,
        "machine_busy_fraction": 0.9,
        **more,
    }


def test_repetitions_alternate_the_order_of_the_replica_counts() -> None:
    spec = ReplicasSpec(replicas=(1, 2))
    assert [spec.order(repeat) for repeat in range(4)] == [(1, 2), (2, 1), (1, 2), (2, 1)]


@pytest.mark.parametrize("counts", [(), (0, 1), (1, 4)])
def test_replica_counts_outside_one_to_three_are_refused(counts: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="replica counts"):
        ReplicasSpec(replicas=counts)


def test_a_bad_link_rate_or_no_repetition_is_refused() -> None:
    with pytest.raises(ValueError, match="not a link rate"):
        ReplicasSpec(link="fast")
    with pytest.raises(ValueError, match="repeats"):
        ReplicasSpec(repeats=0)


def test_between_hosts_the_window_is_the_cross_host_benchs() -> None:
    assert ReplicasSpec(link="1gbit").seconds(10_000_000) == (3.0, 30.0)
    assert ReplicasSpec().seconds(10_000_000) == (3.0, 10.0)
    assert ReplicasSpec(quick=True).seconds(10_000_000) == (0.25, 0.75)
    assert ReplicasSpec().mode == "loopback" and ReplicasSpec(link="1gbit", quick=True).mode == "cross-host 1gbit quick"


def test_each_mode_writes_its_own_results() -> None:
    out = Path("runs/bench")
    assert replicas_path(out, "loopback") == out / "replicas-loopback.json"
    assert replicas_path(out, "cross-host 1gbit quick") == out / "replicas-1gbit-quick.json"


def test_the_primary_is_the_first_process_measured_and_the_busiest_backup_is_reported() -> None:
    result = LoadResult("gemps", 1000, 2, 10.0, [], [50, 50], server_child_cpu_seconds=[0.5, 0.2, 0.3])
    figures = replica_figures(result, 3)
    assert figures["primary_cpu_ms_per_commit"] == pytest.approx(5.0)
    assert figures["backup_cpu_ms_per_commit"] == pytest.approx(3.0)
    single = LoadResult("gemps", 1000, 2, 10.0, [], [50, 50], server_cpu_seconds=0.4, server_child_cpu_seconds=[])
    assert replica_figures(single, 1) == {
        "replicas": 1,
        "primary_cpu_ms_per_commit": pytest.approx(4.0),
        "backup_cpu_ms_per_commit": None,
    }
    unmeasured = LoadResult("gemps", 1000, 2, 10.0, [], [50, 50])
    assert math.isnan(replica_figures(unmeasured, 2)["primary_cpu_ms_per_commit"])


def test_the_ratio_is_the_median_of_each_repetitions_own_ratio() -> None:
    # Repetition 1 ran on a busier machine: both counts slower. Its own ratio is still 0.8.
    runs = [
        run(1000, 1, 0, 100.0),
        run(1000, 2, 0, 90.0, primary=2.0),
        run(1000, 2, 1, 40.0, primary=3.0),
        run(1000, 1, 1, 50.0),
        run(1000, 1, 2, 100.0),
        run(1000, 2, 2, 70.0, primary=4.0),
    ]
    single, double = summarize(runs)
    assert (single["replicas"], double["replicas"]) == (1, 2)
    assert single["commits_per_second"] == 100.0 and single["vs_single"] == 1.0
    assert double["commits_per_second"] == 70.0
    assert double["vs_single"] == pytest.approx(0.8)
    assert double["vs_single_range"] == pytest.approx([0.7, 0.9])
    assert double["primary_cpu_ms_per_commit"] == 3.0 and double["backup_cpu_ms_per_commit"] == 0.5
    assert math.isnan(single["backup_cpu_ms_per_commit"])
    assert double["repeats"] == 3


def test_without_an_r1_run_there_is_no_ratio_and_sizes_stay_apart() -> None:
    rows = summarize([run(1000, 2, 0, 90.0), run(2000, 1, 0, 10.0), run(2000, 2, 0, 5.0)])
    assert [(row["num_parameters"], row["replicas"]) for row in rows] == [(1000, 2), (2000, 1), (2000, 2)]
    assert math.isnan(rows[0]["vs_single"]) and rows[0]["vs_single_range"] is None
    assert rows[2]["vs_single"] == 0.5


def test_the_table_has_a_row_per_size_and_count_with_the_ratio_on_r2() -> None:
    data = {"summary": summarize([run(1_000_000, 1, 0, 30.0), run(1_000_000, 2, 0, 27.0, primary=7.5)])}
    lines = replicas_table(data)
    assert lines[0].startswith("| P | R | runs | commits/s (median) | vs R=1 (range) | primary CPU ms/commit")
    assert lines[2] == "| 1,000,000 | 1 | 1 | 30.00 | - | 1.00 | - | 2.00 | 10 | 90% |"
    assert lines[3] == "| 1,000,000 | 2 | 1 | 27.00 | 0.90x (0.90-0.90) | 7.50 | 0.50 | 2.00 | 10 | 90% |"
