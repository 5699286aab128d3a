"""The worker's and the evaluator's own /metrics (optional; Prometheus finds every replica by
service discovery)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Served:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


class WorkerMetrics(_Served):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.commits = Counter("gemps_worker_commits", "Commits this worker made.", registry=r)
        self.loss = Gauge("gemps_worker_training_loss", "Training loss of the last commit.", registry=r)
        self.staleness = Gauge("gemps_worker_staleness", "Staleness of the last commit.", registry=r)
        self.step_duration = Histogram(
            "gemps_worker_step_duration_seconds",
            "Wall time per commit: local compute plus round trip.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )

    def observe_commit(self, duration: float, loss: float, staleness: int) -> None:
        """One commit: `duration` is the wall time since the previous one (or the first batch)."""
        self.step_duration.observe(duration)
        self.commits.inc()
        self.loss.set(loss)
        self.staleness.set(staleness)


class EvaluatorMetrics(_Served):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.evaluations = Counter("gemps_evaluator_evaluations", "Evaluations of the central variable.", registry=r)
        self.version = Gauge("gemps_evaluator_version", "Central version of the last evaluation.", registry=r)
        self.loss = Gauge("gemps_evaluator_heldout_loss", "Held-out loss of the last evaluation.", registry=r)
        self.accuracy = Gauge(
            "gemps_evaluator_heldout_accuracy_ratio", "Held-out accuracy (0..1) of the last evaluation.", registry=r
        )

    def observe(self, version: int, loss: float, accuracy: float) -> None:
        self.evaluations.inc()
        self.version.set(version)
        self.loss.set(loss)
        self.accuracy.set(accuracy)
