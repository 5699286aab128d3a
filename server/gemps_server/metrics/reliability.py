"""Reliability and security: retried commits answered from the ledger, checkpoint writes, and
requests a guard refused before they reached a handler's logic."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gemps_proto.reasons import Reason
from gemps_server.metrics.buckets import DURATION_BUCKETS

CHECKPOINT_OUTCOMES = ("written", "failed")
# Requests refused before reaching a handler's logic: no or a wrong token, registration rate, a
# budget of calls in progress (--max-concurrent-rpcs, --max-unauthenticated-rpcs, Watch streams).
REFUSAL_REASONS = tuple(
    reason.value
    for reason in (
        Reason.UNAUTHENTICATED,
        Reason.REGISTRATION_RATE,
        Reason.BUSY,
        Reason.UNAUTHENTICATED_LIMIT,
        Reason.WATCH_LIMIT,
    )
)


class ReliabilityMetrics:
    """Every outcome's and refusal reason's series exists from the start, at 0."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duplicates = Counter(
            "gemps_duplicate_commits",
            "Retried commits recognised by request id and answered without applying them again.",
            registry=registry,
        )
        self.checkpoints = Counter(
            "gemps_checkpoints", "Checkpoint writes by outcome (written, failed).", ["outcome"], registry=registry
        )
        for outcome in CHECKPOINT_OUTCOMES:
            self.checkpoints.labels(outcome)
        self.checkpoint_duration = Histogram(
            "gemps_checkpoint_duration_seconds",
            "Time to write one checkpoint (serialise, fsync, rename).",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.checkpoint_version = Gauge(
            "gemps_checkpoint_version",
            "Central version of the newest checkpoint written or restored.",
            registry=registry,
        )
        self.checkpoint_bytes = Gauge(
            "gemps_checkpoint_bytes", "Size of the newest checkpoint written.", registry=registry
        )
        self.refused = Counter(
            "gemps_refused_requests",
            "Requests refused by a guard: reason=unauthenticated (bad or no token), registration_rate, busy "
            "(--max-concurrent-rpcs), unauthenticated_limit (--max-unauthenticated-rpcs), watch_limit.",
            ["reason"],
            registry=registry,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)

    def duplicate(self) -> None:
        self.duplicates.inc()

    def checkpointed(self, version: int, size: int, seconds: float) -> None:
        self.checkpoints.labels("written").inc()
        self.checkpoint_duration.observe(seconds)
        self.checkpoint_version.set(version)
        self.checkpoint_bytes.set(size)

    def checkpoint_failed(self) -> None:
        self.checkpoints.labels("failed").inc()

    def refusal(self, reason: Reason) -> None:
        self.refused.labels(reason.value).inc()
