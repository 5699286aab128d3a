from __future__ import annotations

from gemps_worker.metrics import EvaluatorMetrics, WorkerMetrics
from gemps_worker.monitor import scrape


def test_evaluator_metrics_are_served() -> None:
    metrics = EvaluatorMetrics()
    port = metrics.serve(0, host="127.0.0.1")
    metrics.observe(version=12, loss=0.25, accuracy=0.875)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert samples["gemps_evaluator_evaluations_total"] == 1
    assert samples["gemps_evaluator_version"] == 12
    assert samples["gemps_evaluator_heldout_accuracy_ratio"] == 0.875


def test_worker_metrics_are_served() -> None:
    metrics = WorkerMetrics()
    port = metrics.serve(0, host="127.0.0.1")
    metrics.commits.inc(3)
    metrics.step_duration.observe(0.02)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert samples["gemps_worker_commits_total"] == 3
    assert samples["gemps_worker_step_duration_seconds_count"] == 1


def test_server_figures_are_interval_means_carried_forward_when_idle() -> None:
    import math

    from gemps_worker.monitor import ServerFigures

    before = {"gemps_training_loss_sum": 10.0, "gemps_training_loss_count": 4.0}
    after = {
        "gemps_training_loss_sum": 13.0,
        "gemps_training_loss_count": 6.0,
        "gemps_commit_staleness_sum": 6.0,
        "gemps_commit_staleness_count": 2.0,
    }
    figures = ServerFigures.between(before, after)
    assert figures.training_loss == 1.5 and figures.mean_staleness == 3.0
    assert math.isnan(figures.mean_scaling)
    idle = ServerFigures.between(after, after).or_else(figures)  # no commits in between
    assert idle.training_loss == 1.5 and idle.mean_staleness == 3.0
