"""`gemps bench --quick`: every system and reference point of the suite runs and is reported.

Checks the harness, not the numbers (those are docs/PERFORMANCE.md's, from the full suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gemps_proto import compiled_codes

SYSTEMS = {
    "echo-unary",
    "echo-stream",
    "echo-tcp",
    "gemps",
    "gemps-tcp",
    "gemps-grpc",
    "gemps-bfloat16",
    "gemps-numpy",
    "gemps-no-noise",
    "gemps-2p",
    "gemps-4p",
    "gemps-compact",
    "gemps-downpour",
    "gemps-int8",
    "gemps-downpour-tcp",
    "gemps-recipe-tcp",
    "gemps-adamw",
    "gemps-adamw-tcp",
    "torch-rpc",
    "torch-rpc-tcp",
    "reference-p2p",
}
GEMPS_SYSTEMS = {system for system in SYSTEMS if system.startswith("gemps")}


def test_quick_bench_measures_every_system_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["mode"] == "quick" and data["memcpy_bytes_per_second"] > 0
    assert not data["skipped"], data["skipped"]
    assert {run["system"] for run in data["runs"]} == SYSTEMS
    for run in data["runs"]:
        assert run["commits"] > 0, run
        if run["system"] in GEMPS_SYSTEMS:  # the clients' CPU is measured too (they share the machine)
            assert run["client_cpu_ms_per_commit"] > 0, run
        assert run["latency_p50_ms"] > 0 and run["jain_index"] > 0, run
        assert run["server_peak_rss_bytes"] and run["server_peak_rss_bytes"] > 0, run
        assert run["server_cpu_ms_per_commit"] > 0, run  # the server's CPU time inside the window
    gemps_runs = [r for r in data["runs"] if r["system"] == "gemps"]
    assert {(r["num_parameters"], r["clients"]) for r in gemps_runs} == {
        (size, clients) for size in (10_000, 300_000) for clients in (1, 2)
    }
    for run in gemps_runs:  # GEM's FIFO: every other client commits once between two of yours
        assert abs(run["mean_staleness"] - (run["clients"] - 1)) < 0.5, run
        # a worker's own memory: at least its gradient (4 bytes a parameter), and its θ's copy
        assert run["client_peak_growth_bytes"] >= 4 * run["num_parameters"], run
    cost = data["worker_cost"]
    assert cost["worker_peak_rss_mb"] > 0 and cost["worker_startup_to_first_commit_s"] > 0
    tables = (out / "tables.md").read_text()
    assert "## Targets" in tables and "| 300,000 | 2 |" in tables
    assert (out / "performance.png").stat().st_size > 10_000
    assert "server CPU ms/commit" in tables
    for run in data["runs"]:  # a partitioned server: each partition's CPU, the busiest reported
        if run["system"] in ("gemps-2p", "gemps-4p"):
            assert run["partitions"] == int(run["system"][-2]) and run["busiest_partition_cpu_ms_per_commit"] > 0
            assert run["busiest_partition_cpu_ms_per_commit"] <= run["server_cpu_ms_per_commit"]
    assert "## Partitions of θ" in tables and "| 300,000 | 2 | 4 |" in tables
    # What `gemps plan` is fitted to: each path's rule, state, codes and transport as its variant says.
    paths = {
        run["system"]: (run["rule"], run["gem_state"], run["compression"], run["shared_memory"])
        for run in data["runs"]
        if "rule" in run
    }
    assert paths["gemps"] == ("gem", "exact", "none", True)
    assert paths["gemps-compact"] == ("gem", "compact", "none", True)
    assert paths["gemps-recipe-tcp"] == ("downpour", "exact", "int8", False)
    assert paths["gemps-adamw"] == ("adamw", "exact", "none", True)
    assert paths["gemps-adamw-tcp"] == ("adamw", "exact", "none", False)
    # and the codec's passes it ran: int8 costs 3-7x the CPU through numpy's than compiled
    codes = "numpy" if compiled_codes.compiled is None else "compiled"
    assert {run["codes"] for run in data["runs"] if "rule" in run} == {codes}
    # under rounds, the round's step on the rule alone: what `gemps plan` takes out of a commit's costs
    steps = {run["system"]: run.get("round_step_ms") for run in data["runs"] if run["system"].startswith("gemps")}
    assert all(steps[system] > 0 for system in ("gemps-adamw", "gemps-adamw-tcp")), steps
    assert {system for system, step in steps.items() if step is not None} == {"gemps-adamw", "gemps-adamw-tcp"}


def test_a_chosen_cell_runs_alone(tmp_path: Path) -> None:
    out = tmp_path / "cell"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "gemps_cli", "bench", "--quick", "--sizes", "20K", "--clients", "2"),
            *("--systems", "gemps,echo-unary", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert {(r["system"], r["num_parameters"], r["clients"]) for r in data["runs"]} == {
        ("gemps", 20_000, 2),
        ("echo-unary", 20_000, 2),
    }
    assert data["worker_cost"] == {}
    refused = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "bench", "--systems", "gemps,redis"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "unknown systems redis" in refused.stderr
