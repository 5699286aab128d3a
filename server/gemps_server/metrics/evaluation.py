"""The evaluator's held-out figures of the central variable (series appear with the first report:
0 would read as a perfect loss)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

# Longest `dataset` label value taken from an evaluator's report.
MAX_DATASET_LABEL = 64
# Distinct `dataset` label values kept; reports naming further datasets go under "other", so a
# client cannot grow the server's series (and memory) without bound.
MAX_DATASET_LABELS = 8


class EvaluationMetrics:
    """The last report per dataset, under a bounded set of `dataset` labels."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.held_out_loss = Gauge(
            "gemps_heldout_loss", "Evaluator's held-out loss of the central variable.", ["dataset"], registry=registry
        )
        self.held_out_accuracy = Gauge(
            "gemps_heldout_accuracy_ratio",
            "Evaluator's held-out accuracy (0..1) of the central variable.",
            ["dataset"],
            registry=registry,
        )
        self._datasets: set[str] = set()
        self.evaluated_version = Gauge(
            "gemps_heldout_evaluated_version",
            "Central version the last evaluation measured.",
            ["dataset"],
            registry=registry,
        )

    def evaluated(self, dataset: str, version: int, loss: float, accuracy: float) -> None:
        label = (dataset or "unknown")[:MAX_DATASET_LABEL]
        if label not in self._datasets:
            if len(self._datasets) >= MAX_DATASET_LABELS:
                label = "other"
            self._datasets.add(label)
        self.evaluated_version.labels(label).set(version)
        self.held_out_loss.labels(label).set(loss)
        self.held_out_accuracy.labels(label).set(accuracy)
