"""The GPT-2 job (scripts/gpu_job.py, issue 79 items 1 and 4) reduced for CI: the same code path as
the GPT-2-small run (its config, K partition processes, worker processes with AdamW in LocalSteps and
int8 codes both ways, `gemps export`, a strict load into a fresh Hugging Face model that generates,
the AdamW process alone), on its CPU path, with 2 layers of width 64 and a few steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_job.py"
TINY = ("--layers", "2", "--heads", "2", "--width", "64", "--context", "32", "--device", "cpu")


def test_a_small_gpt2_trains_through_partitions_exports_loads_strictly_and_generates(tmp_path: Path) -> None:
    record_path = tmp_path / "job.json"
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), *TINY, "--steps", "8", "--workers", "2", "--partitions", "2"),
            *("--alone", "--folder", str(tmp_path / "job"), "--json", str(record_path)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    record = json.loads(record_path.read_text())
    summary = record["summary"]
    # 2 workers x 8 steps, a commit each step; the server applied every one (its partitions' logs).
    assert summary["commits"] == 16 and [len(worker["losses"]) for worker in record["workers"]] == [8, 8]
    assert record["commits_applied"] == [16, 16]
    # Each partition wrote its final checkpoint at its graceful stop, and started again from it.
    assert record["restored_versions"] == [16, 16] and record["restart_seconds"] > 0
    assert len(record["checkpoints"]) >= 2 and all(event["bytes"] > 0 for event in record["checkpoints"])
    # It learned: the held-out loss of the exported θ, loaded strictly into a fresh model, fell from
    # the untrained model's (ln 256 = 5.55 nats a byte, about) by a clear margin in 16 steps.
    assert record["strict_load"] is True and record["export_bytes"] > 4 * record["parameters"] * 0.99
    assert record["initial_held_out_loss"] > 5.0
    assert summary["held_out_drop_nats"] > 0.2, summary
    assert len(record["generated"].encode("utf-8", errors="replace")) > 0
    # The process alone ran the workers' tokens together, and every figure the GPU run reports is there.
    assert len(record["alone"]["losses"]) == 16 and record["alone"]["held_out_loss"] < record["initial_held_out_loss"]
    assert summary["workers_tokens_per_s"] > 0 and summary["alone_tokens_per_s"] > 0
    assert 0 < summary["optimizer_share_of_step"] < 1
    assert "gpu_utilisation_mean" not in summary  # no GPU here: nothing sampled, nothing claimed
