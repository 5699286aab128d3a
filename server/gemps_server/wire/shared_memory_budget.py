"""How much shared memory the local data-plane connections may have attached (issue 42, item 6):
at most PER_WORKER regions per worker, so that one ticket cannot take every place, and all of
them together within --max-shared-memory (shared_memory.py maps them).

The pages are their clients' (shared_memory.py: written by the client before it attaches, and
sealed against hole punching once mapped), so this bound is not about who pays for them: it is
what the server's RSS shows of them (RssShmem, which the OOM killer counts against the server
too) and how many θ-sized mappings it holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import ResourceExhausted
from gemps_server.logs import event
from gemps_server.memory_budget import Headroom, headroom, size
from gemps_server.metrics import ServerMetrics

log = logging.getLogger("gemps.server")

#: --max-shared-memory 0 (auto) is at most this share of what the server may still use when the
#: first region is attached (beside a θ-sized region for every one of --max-workers)
AUTO_SHARE = 2
#: Regions one worker's connections may have attached at once: its SDK holds one (two while a
#: connection it replaced is not closed yet), so one ticket cannot take every place.
PER_WORKER = 2


class SharedMemoryBudget:
    """Bytes of shared memory every local connection together may have attached: `configured`
    (--max-shared-memory, bytes), or when 0 settled at the first ATTACH, once θ's size is known:
    one θ for each of `max_workers`, at most 1/AUTO_SHARE of `memory_budget` (--memory-budget-mb,
    bytes) or, without one, of what `probe` says the server may still use; and at most PER_WORKER
    regions per worker. Reserved before a region is mapped, given back when it is closed."""

    def __init__(
        self,
        configured: int,
        metrics: ServerMetrics,
        max_workers: int,
        memory_budget: int = 0,
        probe: Callable[[], Headroom | None] = headroom,
    ) -> None:
        self._metrics = metrics
        self._max_workers = max_workers
        self._memory_budget = memory_budget
        self._probe = probe
        self.limit: int | None = configured or None
        self.source = "--max-shared-memory"
        self.attached = 0
        self.regions = 0
        self._owners: dict[str, int] = {}  # regions attached by each worker's connections
        self._lock = threading.Lock()  # taken on the data plane's thread, and by whoever closes a region
        metrics.traffic.shared_memory_limit.set(self.limit or 0)

    def settle(self, theta_bytes: int) -> int:
        """The bound, settled now if it is auto (said once, INFO)."""
        if self.limit is not None:
            return self.limit
        room = Headroom(self._memory_budget, "--memory-budget-mb") if self._memory_budget else self._probe()
        self.limit = self._max_workers * theta_bytes
        self.source = f"--max-shared-memory 0: θ's {size(theta_bytes)} for each of --max-workers {self._max_workers}"
        if room is not None and room.bytes // AUTO_SHARE < self.limit:
            self.limit = max(0, room.bytes // AUTO_SHARE)
            self.source = f"--max-shared-memory 0: half of {size(room.bytes)}, {room.source}"
        self._metrics.traffic.shared_memory_limit.set(self.limit)
        event(log, "shared memory bound settled", bound=size(self.limit), source=self.source)
        return self.limit

    def reserve(self, nbytes: int, theta_bytes: int, owner: str) -> Callable[[], None]:
        """Take `nbytes` for a region of the worker `owner`; what gives them back (once).
        ResourceExhausted (shared_memory_limit) past the bound, or past PER_WORKER regions for
        `owner`: the client sends θ on its socket instead."""
        limit = self.settle(theta_bytes)
        with self._lock:
            held = self._owners.get(owner, 0)
            if held >= PER_WORKER:
                raise ResourceExhausted(
                    f"shared memory refused: worker {owner!r} has {held} other connections with shared memory "
                    f"attached (at most {PER_WORKER} a worker, within --max-shared-memory); send θ on the socket "
                    "instead",
                    Reason.SHARED_MEMORY_LIMIT,
                )
            if self.attached + nbytes > limit:
                raise ResourceExhausted(
                    f"shared memory refused: {self.regions} local connections have {size(self.attached)} attached "
                    f"and the server's bound is {size(limit)} ({self.source}); send θ on the socket instead, or "
                    "raise the server's --max-shared-memory",
                    Reason.SHARED_MEMORY_LIMIT,
                )
            self._count(owner, nbytes, 1)
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._count(owner, -nbytes, -1)

        return release

    def _count(self, owner: str, nbytes: int, regions: int) -> None:
        self.attached += nbytes
        self.regions += regions
        held = self._owners.get(owner, 0) + regions
        if held:
            self._owners[owner] = held
        else:
            del self._owners[owner]
        self._metrics.traffic.shared_memory.set(self.attached)
