"""Local steps that hold accuracy (issue 59, item 2), reduced: one seed of the local-steps suite's
float32 gradient commits and its recommended setting (8 local Adam steps, the update times 0.35,
int8 both ways) at 10 workers on the digits CNN, each a real server and real worker processes.

The full measurement is docs/RESULTS.md "Local steps that hold accuracy" (6 seeds, 10 and 30
workers, the character LM): +0.56 / -0.19 points. One seed's difference has a spread of about
0.55 points, so the bound here is 1.5 points; issue 47's local SGD steps at eta (-2 to -3.3 points
over three seeds) fall outside it more often than not."""

from __future__ import annotations

from pathlib import Path

from gemps_worker.experiment.analysis import summarize
from gemps_worker.experiment.single_run import run
from gemps_worker.experiment.suite import local_steps_suite


def test_eight_local_adam_steps_in_int8_hold_the_accuracy_of_float32_gradients(tmp_path: Path) -> None:
    runs = {c.name: c for c in local_steps_suite()}
    gradient = summarize(run(runs["gem-n10"], tmp_path / "gradient"))
    local = summarize(run(runs["gem-n10-local8-adam"], tmp_path / "local"))
    assert (gradient.diverged_workers, local.diverged_workers) == (0, 0)
    # 220 mini-batches a worker (10 epochs of 22) in 220 commits, or in 27 of 8 (a last window of 4 is
    # not committed: the mode commits whole windows)
    assert (gradient.commits, local.commits) == (10 * 220, 10 * (220 // 8))
    assert gradient.bytes_moved / local.bytes_moved >= 30  # int8 both ways, 8 mini-batches a commit
    points = 100 * (local.held_out_accuracy - gradient.held_out_accuracy)
    assert points >= -1.5, f"local steps {points:+.2f} points against float32 gradient commits"
