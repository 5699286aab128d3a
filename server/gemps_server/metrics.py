"""Prometheus metrics of one server instance (its own registry, so several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gemps_server.rules import ApplyStats

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SCALING_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0)
DURATION_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.commits = Counter(
            "gemps_commits",
            "Commits by outcome (applied/rejected) and rejection reason.",
            ["outcome", "reason"],
            registry=r,
        )
        self.staleness = Histogram(
            "gemps_commit_staleness",
            "Staleness tau of applied commits, in updates.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.scaling = Histogram(
            "gemps_scaling_factor",
            "Mean per-parameter scaling (GEM's pi) of each applied commit.",
            buckets=SCALING_BUCKETS,
            registry=r,
        )
        self.scaling_median = Gauge(
            "gemps_scaling_factor_median", "Median per-parameter scaling of the last commit.", registry=r
        )
        self.scaling_at_zero = Gauge(
            "gemps_scaling_factor_at_zero_ratio",
            "Fraction of parameters scaled by 0 in the last commit.",
            registry=r,
        )
        self.scaling_at_max = Gauge(
            "gemps_scaling_factor_at_max_ratio",
            "Fraction of parameters clamped at pi_max in the last commit.",
            registry=r,
        )
        self.operation_duration = Histogram(
            "gemps_commit_duration_seconds",
            "Applier time per operation, by phase (queue wait, apply).",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.active_workers = Gauge("gemps_active_workers", "Registered workers holding a lease.", registry=r)
        self.version = Gauge("gemps_central_version", "Commits applied to the central variable.", registry=r)
        self.training_loss = Gauge(
            "gemps_training_loss", "Training loss reported with the last commit that carried one.", registry=r
        )
        self.queue_depth = Gauge("gemps_queue_depth", "Operations waiting for the applier.", registry=r)
        self.held_out_loss = Gauge(
            "gemps_heldout_loss", "Evaluator's held-out loss of the central variable.", registry=r
        )
        self.held_out_accuracy = Gauge(
            "gemps_heldout_accuracy_ratio",
            "Evaluator's held-out accuracy (0..1) of the central variable.",
            registry=r,
        )
        self.evaluated_version = Gauge(
            "gemps_heldout_evaluated_version", "Central version the last evaluation measured.", registry=r
        )

    def observe_operation(self, queued_seconds: float, run_seconds: float) -> None:
        self.operation_duration.labels("queue_wait").observe(queued_seconds)
        self.operation_duration.labels("apply").observe(run_seconds)

    def applied(self, staleness: int, stats: ApplyStats, version: int, loss: float | None) -> None:
        self.commits.labels("applied", "").inc()
        self.staleness.observe(staleness)
        self.scaling.observe(stats.scaling_mean)
        self.scaling_median.set(stats.scaling_median)
        self.scaling_at_zero.set(stats.fraction_at_zero)
        self.scaling_at_max.set(stats.fraction_at_max)
        self.version.set(version)
        if loss is not None:
            self.training_loss.set(loss)

    def evaluated(self, version: int, loss: float, accuracy: float) -> None:
        self.evaluated_version.set(version)
        self.held_out_loss.set(loss)
        self.held_out_accuracy.set(accuracy)

    def rejected(self, reason: str) -> None:
        self.commits.labels("rejected", reason).inc()
