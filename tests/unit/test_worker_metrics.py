from __future__ import annotations

from pathlib import Path

from gemps_worker.metrics import EvaluatorMetrics, WorkerMetrics
from tests.helpers import scrape


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


def test_commit_figures_are_interval_means_carried_forward_when_idle() -> None:
    import math

    from gemps_worker.commit_log import CommitFigures
    from gemps_worker.training import StepRecord

    def record(loss: float, staleness: int) -> StepRecord:
        return StepRecord(step=1, version=1, loss=loss, staleness=staleness, scaling_mean=math.nan, time=0.0)

    figures = CommitFigures.of([record(1.0, 2), record(2.0, 4)])
    assert figures.training_loss == 1.5 and figures.mean_staleness == 3.0
    assert math.isnan(figures.mean_scaling)
    idle = CommitFigures.of([]).or_else(figures)  # no commits in between
    assert idle.training_loss == 1.5 and idle.mean_staleness == 3.0


def test_report_tail_reads_only_complete_new_lines(tmp_path: Path) -> None:
    import json
    from dataclasses import asdict

    from gemps_worker.commit_log import ReportTail
    from gemps_worker.training import StepRecord

    path = tmp_path / "worker.jsonl"
    tail = ReportTail(path)
    assert tail.read_new() == []  # not written yet
    first = StepRecord(step=1, version=3, loss=0.5, staleness=1, scaling_mean=1.0, time=0.0)
    with open(path, "w") as report:
        report.write(json.dumps(asdict(first)) + "\n" + '{"step": 2, "ver')  # a line still being written
    assert tail.read_new() == [first]
    with open(path, "a") as report:
        report.write('sion": 4, "loss": 0.25, "staleness": 0, "scaling_mean": 1.0, "time": 1.0}\n')
    assert [r.version for r in tail.read_new()] == [4]
    assert tail.read_new() == []
