"""Commits: their outcomes, staleness, the loss and samples workers report, and the applier's time.

Every family here is recorded per commit or per applier operation: accumulators (a few additions
an event, see accumulators.py), not prometheus_client's families."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from gemps_proto.reasons import Reason
from gemps_server.metrics.accumulators import CounterFamily, HistogramFamily, SummaryFamily
from gemps_server.metrics.buckets import DURATION_BUCKETS

# Staleness in updates: fine where most commits land (0..16 at 10 workers), up to a few hundred
# (100 workers) and beyond.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
# Why a commit can be refused (gemps_proto.reasons). Their series exist from the start at 0, so
# "rejected by reason" panels and rate() show 0 rather than nothing.
COMMIT_REJECTION_REASONS = tuple(reason.value for reason in Reason)


class CommitMetrics:
    """What each commit's outcome adds up to, and how long the single applier thread is busy."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # "applied" first, then every reason: the children's (and the page's) order.
        outcomes = [("applied", ""), *(("rejected", reason) for reason in COMMIT_REJECTION_REASONS)]
        self.commits = CounterFamily(
            registry,
            "gemps_commits",
            "Commits by outcome (applied/rejected) and rejection reason.",
            ["outcome", "reason"],
            outcomes,
        )
        # The hot path's children, resolved once.
        self._applied = self.commits.child("applied", "")
        self._rejected = {Reason(reason): self.commits.child("rejected", reason) for reason in COMMIT_REJECTION_REASONS}
        self.staleness = HistogramFamily(
            registry,
            "gemps_commit_staleness",
            "Staleness tau of applied commits: commits applied since the one the worker computed on.",
            STALENESS_BUCKETS,
        )
        self.samples = CounterFamily(
            registry, "gemps_training_samples", "Training samples behind applied commits, as workers report them."
        )
        self.training_loss = SummaryFamily(
            registry, "gemps_training_loss", "Training (mini-batch) loss workers report with their commits."
        )
        self.commit_duration = HistogramFamily(
            registry,
            "gemps_commit_duration_seconds",
            "Applied commits by phase: queue_wait (FIFO queue before the applier) and apply (the rule).",
            DURATION_BUCKETS,
            ["phase"],
            [("queue_wait",), ("apply",)],
        )
        self._queue_wait = self.commit_duration.child("queue_wait")
        self._apply = self.commit_duration.child("apply")
        self.applier_busy = CounterFamily(
            registry,
            "gemps_applier_busy_seconds",
            "Time the single applier thread spent running operations (rate: its utilisation, 0..1).",
        )
        self.applier_cpu = CounterFamily(
            registry,
            "gemps_applier_cpu_seconds",
            "CPU time the operations of the single applier took (busy seconds less the time other threads and "
            "processes had the core: what an operation costs, whatever the machine's load).",
        )

    def applied(
        self, staleness: int, loss: float | None, num_samples: int | None, queued_seconds: float, apply_seconds: float
    ) -> None:
        self.commits.inc(1.0, self._applied)
        self.staleness.observe(staleness)
        self.commit_duration.observe(queued_seconds, self._queue_wait)
        self.commit_duration.observe(apply_seconds, self._apply)
        if loss is not None and math.isfinite(loss):
            self.training_loss.observe(loss)
        if num_samples:
            self.samples.inc(num_samples)

    def rejected(self, reason: Reason) -> None:
        self.commits.inc(1.0, self._rejected[reason])

    def applier_ran(self, run_seconds: float, cpu_seconds: float = 0.0) -> None:
        """Called on the applier's thread after every operation it ran (commit or not)."""
        self.applier_busy.inc(run_seconds)
        self.applier_cpu.inc(cpu_seconds)
