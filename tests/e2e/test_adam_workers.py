"""Asynchronous AdamW workers through a real server against one AdamW worker (issue 59, item 1),
reduced for CI: scripts/adam_workers.py as a user runs it, 6,400 samples (the full run, 204,800,
is docs/RESULTS.md's), each process in its own CPU quota (root only: skipped with one line
elsewhere). The alone worker has a whole core (its losses at equal samples do not depend on its
quota, only its times, which this test does not judge) and a snapshot every 6 s, not 2: 249 s of
the suite's serial phase became 115 (each snapshot is a second and more of evaluation). The 4
workers, LocalSteps with look-ahead, must learn at equal samples nearly as far as the one worker,
and the script must leave no quota group behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gemps_bench.alternatives.cgroups import CPU_ROOT, unavailable_reason

from gemps_worker.text_data import stdlib_text, unigram_entropy

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "adam_workers.py"


def groups() -> set[str]:
    return {p.name for p in CPU_ROOT.glob("gemps-alt-*-adam-workers")} if CPU_ROOT.exists() else set()


def test_four_adamw_workers_through_gemps_learn_nearly_as_one_at_equal_samples(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    before = groups()
    record = tmp_path / "workers.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--samples", "6400", "--gemps-factor", "1", "--alone-cpu", "1",
         "--snapshot-every", "6", "--json", str(record)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    result = json.loads(record.read_text())
    alone, gemps = result["summary"]["alone"], result["summary"]["gemps x1"]
    assert alone["samples"] == gemps["samples"] == 6400  # every worker's share committed, none lost
    floor = unigram_entropy(stdlib_text()[3])  # what a model that ignores context reaches
    assert alone["loss"] < floor - 0.6 and gemps["loss"] < floor - 0.4, (floor, result["summary"])
    # measured 2026-11-28: +7.6 % at 6,400 samples, all of them in the warm-up (+0.9 % at 204,800)
    assert gemps["loss_vs_alone"] < 0.15, result["summary"]
    curve = result["gemps"]["x1"]
    assert curve[-1][2] < curve[0][2] and [p[0] for p in curve] == sorted(p[0] for p in curve)
    assert groups() == before
