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
