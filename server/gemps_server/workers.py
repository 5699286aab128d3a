"""Registered workers: identities, data-shard slots and leases."""

from __future__ import annotations

import heapq
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from gemps_proto.reasons import Reason
from gemps_server.errors import NotFound, ResourceExhausted


@dataclass
class WorkerRecord:
    worker_id: str
    name: str
    slot: int  # distinct among active workers: the worker's shard index
    last_seen: float
    commits: int = 0


class WorkerRegistry:
    """Tracks active workers; a worker silent for longer than the lease TTL is expired."""

    def __init__(self, max_workers: int, lease_ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_workers = max_workers
        self.lease_ttl = lease_ttl
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        self._free_slots: list[int] = []  # min-heap of slots released by departed workers
        self._next_slot = 0

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def add(self, name: str) -> WorkerRecord:
        if len(self._workers) >= self.max_workers:
            raise ResourceExhausted(
                f"server is full: {self.max_workers} workers registered (raise --max-workers)",
                Reason.MAX_WORKERS,
            )
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        record = WorkerRecord(uuid.uuid4().hex, name, slot, self._clock())
        self._workers[record.worker_id] = record
        return record

    def get(self, worker_id: str) -> WorkerRecord:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFound(
                f"unknown worker {worker_id!r}: never registered, left, or evicted after "
                f"{self.lease_ttl:g}s without a commit; register again",
                Reason.UNKNOWN_WORKER,
            ) from None

    def touch(self, worker_id: str) -> WorkerRecord:
        record = self.get(worker_id)
        record.last_seen = self._clock()
        return record

    def remove(self, worker_id: str) -> WorkerRecord | None:
        record = self._workers.pop(worker_id, None)
        if record is not None:
            heapq.heappush(self._free_slots, record.slot)
        return record

    def expired(self) -> list[str]:
        deadline = self._clock() - self.lease_ttl
        return [w.worker_id for w in self._workers.values() if w.last_seen < deadline]
