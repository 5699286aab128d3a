"""Commit deduplication: the outcome of recent commits by their client-chosen request id.

A client that lost a Commit's reply (the server crashed, paused, or the deadline passed) sends
the same commit again with the same `request_id`. When the first one was applied, the server
must not apply it again: it answers with the recorded outcome instead. Each worker has at most
one commit in flight, so remembering each worker's last commit is enough; a worker that left or
was evicted keeps its last one in a bounded FIFO (it may be retrying from a new registration).
The ledger lives on the applier thread, like the rest of the state, and goes into checkpoints so
that a retry across a server restart is recognised too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gemps_server.rules import ApplyStats

# Longest request id accepted: ids are opaque, and this bounds the ledger's memory.
MAX_REQUEST_ID_LENGTH = 128


@dataclass(frozen=True)
class Receipt:
    """What a commit did: the version it produced, its staleness and how it was scaled."""

    version: int
    staleness: int
    stats: ApplyStats

    def to_list(self) -> list[float]:
        s = self.stats
        return [self.version, self.staleness, s.scaling_mean, s.scaling_median, s.fraction_at_zero, s.fraction_at_max]

    @classmethod
    def from_list(cls, values: list[float]) -> Receipt:
        if len(values) != 6:
            raise ValueError(f"a receipt has 6 numbers, not {len(values)}")
        version, staleness, mean, median, zero, at_max = values
        if int(version) != version or int(staleness) != staleness or version < 0 or staleness < 0:
            raise ValueError(f"bad receipt version/staleness {version!r}, {staleness!r}")
        return cls(int(version), int(staleness), ApplyStats(float(mean), float(median), float(zero), float(at_max)))


class CommitLedger:
    """Receipts of each active worker's last commit, plus the last commits of up to `capacity`
    departed workers (and those restored from a checkpoint), oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._receipts: dict[str, Receipt] = {}  # request id -> receipt
        self._last_of_worker: dict[str, str] = {}  # worker id -> its last request id
        self._departed: OrderedDict[str, None] = OrderedDict()  # request ids of departed workers

    def __len__(self) -> int:
        return len(self._receipts)

    def lookup(self, request_id: str) -> Receipt | None:
        return self._receipts.get(request_id) if request_id else None

    def record(self, worker_id: str, request_id: str, receipt: Receipt) -> None:
        if not request_id:
            return
        previous = self._last_of_worker.get(worker_id)
        if previous is not None and previous != request_id:
            self._receipts.pop(previous, None)
        self._last_of_worker[worker_id] = request_id
        self._receipts[request_id] = receipt

    def forget_worker(self, worker_id: str) -> None:
        """The worker left or was evicted: keep its last receipt among the departed ones."""
        request_id = self._last_of_worker.pop(worker_id, None)
        if request_id is not None:
            self._keep_departed(request_id)

    def entries(self) -> dict[str, Receipt]:
        """Every receipt held (for checkpoints)."""
        return dict(self._receipts)

    def restore(self, receipts: dict[str, Receipt]) -> None:
        """Receipts from a checkpoint: their workers are gone, so they count as departed."""
        for request_id, receipt in receipts.items():
            self._receipts[request_id] = receipt
            self._keep_departed(request_id)

    def _keep_departed(self, request_id: str) -> None:
        self._departed[request_id] = None
        self._departed.move_to_end(request_id)
        while len(self._departed) > self.capacity:
            oldest, _ = self._departed.popitem(last=False)
            if oldest not in self._last_of_worker.values():
                self._receipts.pop(oldest, None)
