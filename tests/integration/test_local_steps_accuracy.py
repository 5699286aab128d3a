"""Local steps that hold accuracy (issue 59, item 2), reduced: the local-steps suite's float32
gradient commits (one seed) and its recommended setting (8 local Adam steps, the update times 0.35,
int8 both ways; seeds 0 and 1) at 10 workers on the digits CNN, each a real server and real worker
processes.

The full measurement is docs/RESULTS.md "Local steps that hold accuracy" (6 seeds, 10 and 30
workers, the character LM): +0.56 / -0.19 points. Asynchronous runs interleave differently each
time: one run of the setting in about twenty ended 2.5 points low (95.5 %; the others 97.8-99.4 %),
so the bound is on the mean of two seeds, 1.5 points; issue 47's local SGD steps at eta (-2 to -3.3
points over three seeds) fall outside it more often than not."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from gemps_worker.experiment.analysis import summarize
from gemps_worker.experiment.single_run import run
from gemps_worker.experiment.suite import local_steps_suite


def test_eight_local_adam_steps_in_int8_hold_the_accuracy_of_float32_gradients(tmp_path: Path) -> None:
    runs = {c.name: c for c in local_steps_suite()}
    gradient = summarize(run(runs["gem-n10"], tmp_path / "gradient"))
    setting = runs["gem-n10-local8-adam"]
    local = [summarize(run(dataclasses.replace(setting, seed=seed), tmp_path / f"local-{seed}")) for seed in (0, 1)]
    assert gradient.diverged_workers == 0 and [r.diverged_workers for r in local] == [0, 0]
    # 220 mini-batches a worker (10 epochs of 22) in 220 commits, or in 27 of 8 (a last window of 4 is
    # not committed: the mode commits whole windows)
    assert gradient.commits == 10 * 220 and [r.commits for r in local] == [10 * (220 // 8)] * 2
    assert gradient.bytes_moved / local[0].bytes_moved >= 30  # int8 both ways, 8 mini-batches a commit
    accuracies = [100 * r.held_out_accuracy for r in local]
    points = statistics.fmean(accuracies) - 100 * gradient.held_out_accuracy
    assert points >= -1.5, f"local steps {accuracies} against float32 gradient commits: {points:+.2f} points"
