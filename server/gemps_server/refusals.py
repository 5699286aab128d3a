"""Requests the service refused, and commits it had applied already: counted, and logged at a
bounded rate. A misbehaving client can send thousands of bad requests a second: at most one line
per (method, reason) a second is logged, with the count of those left out; the metrics count
every one."""

from __future__ import annotations

import logging
import threading

from gemps_server.domain.errors import ServiceError
from gemps_server.logs import Throttle, event
from gemps_server.metrics import ServerMetrics

log = logging.getLogger("gemps.server")

# The RPCs that commit: a refusal of either counts as a rejected commit (Status, metrics).
COMMIT_METHODS = frozenset({"Commit", "CommitStream"})


class Refusals:
    """The refusals of one service, and its duplicate commits."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()  # refusals are counted from several threads
        self._log = Throttle(interval=1.0)
        self.commits_rejected = 0

    def rejected(self, method: str, error: ServiceError, status: str) -> None:
        """Count and log (throttled) a request refused with gRPC status `status`."""
        if method in COMMIT_METHODS:
            with self._lock:
                self.commits_rejected += 1
            self._metrics.rejected(error.reason)
        suppressed = self._log.allow((method, error.reason))
        if suppressed is not None:
            event(
                log,
                "rejected",
                method=method,
                code=status,
                reason=error.reason.value,
                detail=error.message,
                suppressed=suppressed,
            )

    def duplicate(self, worker_id: str, request_id: str, version: int) -> None:
        """Count and log (throttled) a commit whose request id was applied already (answered with
        that commit's outcome at `version`, not applied again)."""
        self._metrics.duplicate()
        suppressed = self._log.allow(("Commit", "duplicate"))
        if suppressed is not None:
            event(
                log,
                "duplicate commit",
                worker_id=worker_id,
                request_id=request_id,
                version=version,
                suppressed=suppressed,
            )
