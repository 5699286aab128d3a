"""The reduced experiment (a few workers, few steps) through the real CLI, server and workers."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemps_worker.experiment.suite import quick_suite

DIGITS_CNN_PARAMETERS = 38_282


def test_quick_experiment_writes_curves_figures_and_report(tmp_path: Path) -> None:
    out, report = tmp_path / "runs", tmp_path / "report"
    command = [
        sys.executable,
        "-m",
        "gemps_cli",
        "experiment",
        "--suite",
        "quick",
        "--out",
        str(out),
        "--report",
        str(report),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

    summaries = {s["name"]: s for s in json.loads((report / "summary.json").read_text())}
    assert set(summaries) == {c.name for c in quick_suite()}
    for config in quick_suite():
        s = summaries[config.name]
        commits_per_worker = 44 if config.mode == "gradient" else 44 // 4  # 2 epochs of 22 batches
        assert s["commits"] == config.workers * commits_per_worker, s
        assert s["diverged_workers"] == 0
        # The final central variable on all 1,438 training images; 8 bytes per parameter per commit
        # (payload out, theta back; none of the quick suite's modes is easgd).
        assert 0 < s["final_train_loss_full"] < 10 and 0 <= s["final_train_accuracy_full"] <= 1
        assert s["bytes_moved"] == pytest.approx(s["commits"] * 8 * DIGITS_CNN_PARAMETERS / 1e6)
        with open(report / "curves" / f"{config.name}.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == commits_per_worker
        assert all(int(r["workers_at_step"]) == config.workers for r in rows)
    # Under FIFO with 4 workers, GEM's commits see about n-1 = 3 others in between.
    assert 2.0 <= summaries["gem-n4"]["mean_staleness"] <= 4.0
    # The 1/(tau+1) rule scaled every commit by exactly 1/(its staleness + 1); how stale the
    # commits were depends on how the 4 workers' steps interleave on a loaded machine (a busy one
    # measured mean π 0.43: staleness below 3).
    adaptive = [
        json.loads(line)
        for path in sorted((out / "adaptive-staleness-n4").glob("records-*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    assert len(adaptive) == summaries["adaptive-staleness-n4"]["commits"]
    for record in adaptive:
        assert record["scaling_mean"] == pytest.approx(1 / (record["staleness"] + 1), rel=1e-5), record
    assert 0.15 <= summaries["adaptive-staleness-n4"]["mean_pi"] < 0.6  # stale commits were scaled down
    for figure in ("fig1_gem_workers.png", "fig2_downpour_adaptive.png", "fig3_pi.png", "fig_methods.png"):
        assert (report / figure).read_bytes()[:4] == b"\x89PNG"
    markdown = (report / "RESULTS.md").read_text()
    assert "| gem-n4 | 4 |" in markdown and "momentum proxy" in markdown
    assert "full-train loss" in markdown and "MB moved" in markdown
    assert json.loads((report / "summary_by_config.json").read_text()) == []  # one seed: no mean ± sd

    # Resumable: a second invocation reuses every run instead of training again.
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("reusing") == len(quick_suite())

    # A second seed of the one-worker proxy: seed 0 is reused under its plain name, seed 1 runs
    # (its initial weights registered first, with seed 1) as momentum-n1-s1; mean ± sd over both.
    seeded_report = tmp_path / "seeded"
    seeded = subprocess.run(
        [*command[:-1], str(seeded_report), "--seeds", "2", "--runs", "momentum-n1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    assert seeded.stdout.count("reusing") == 1 and "momentum-n1-s1: 1 workers" in seeded.stdout
    (by_config,) = json.loads((seeded_report / "summary_by_config.json").read_text())
    assert by_config["name"] == "momentum-n1" and by_config["runs"] == 2 and by_config["seeds"] == [0, 1]
    assert "## Mean ± sd over seeds" in (seeded_report / "RESULTS.md").read_text()
