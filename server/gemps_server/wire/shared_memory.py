"""Shared memory a local data-plane client attaches (DataPlaneAttach, gemps_proto/data_plane_frames.py).

The client makes a memfd of θ's float32 size, writes it whole (or posix_fallocates it), seals it
against shrinking, and passes it over its Unix socket; the server maps it and from then on reads
that client's payloads from it and writes the replies' θ into it.

Whose memory it is (issue 42, item 6): a page of a memfd is charged (its cgroup's memory) to the
process that first makes it exist. A memfd its client never wrote has no pages yet, so the
server's first reply would make them all, in its own cgroup: 200 such connections at P = 1M
added 800 MiB to the server. So a memfd is mapped only when every page of it exists already
(st_blocks covers its size: its client's, where its client is charged), and what is mapped is
bounded (SharedMemoryBudget): at most PER_WORKER regions per worker, so that one ticket cannot
take every place, and all connections together within --max-shared-memory. Past either an
ATTACH is refused RESOURCE_EXHAUSTED (shared_memory_limit) and that client sends θ on its socket.

What this does not prevent: a client that frees its pages after attaching (fallocate
PUNCH_HOLE, madvise MADV_REMOVE: a seal against shrinking allows both) makes the server's next
reply fault them in again, charged to the server; and the pages the server maps count in its RSS
(RssShmem, and so in the OOM killer's choice) whoever is charged. Both are at most the bound.

Trust (DESIGN §3b): a descriptor is mapped only when it is a memfd (it has seals), sealed against
shrinking (a file cut short under a mapping would kill this process with SIGBUS on the next read),
of ordinary pages (hugetlb pages can run out), readable and writable, exactly the size announced
and expected, and written whole. The client can still write into the memory at any time, so a
payload is copied out before it is checked (see data_plane_calls.Connection._commit), never used
in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable

import numpy as np

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import InvalidArgument, ResourceExhausted
from gemps_server.logs import event
from gemps_server.memory_budget import Headroom, headroom, size
from gemps_server.metrics import ServerMetrics
from gemps_server.wire.stream_buffers import Buffer

log = logging.getLogger("gemps.server")

#: --max-shared-memory 0 (auto): room for this many θ-sized regions (local workers)...
AUTO_REGIONS = 16
#: ...and at most this share of what the server may still use when the first is attached
AUTO_SHARE = 4
#: Regions one worker's connections may have attached at once: its SDK holds one (two while a
#: connection it replaced is not closed yet), so one ticket cannot take every place.
PER_WORKER = 2


class SharedRegion:
    """An attached memfd, mapped read-write: `view` is its bytes, `buffer` the same bytes as a
    reply writer's target (stream_buffers.Buffer), `floats` as float32 (where a rule writes θ)."""

    def __init__(self, fd: int, size: int, on_close: Callable[[], None] = lambda: None) -> None:
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._on_close = on_close
        self.view = memoryview(self._map)
        self.buffer = Buffer(np.frombuffer(self._map, np.uint8))
        self.floats = np.frombuffer(self._map, np.float32)  # θ's float32 values, as a rule's mirror

    def close(self) -> None:
        """Unmap it (once nothing uses it any more: a reply may still be reading from a view), and
        give its bytes back to the budget."""
        self._on_close()
        self._on_close = _nothing
        self.buffer = Buffer(np.empty(0, np.uint8))
        self.floats = np.empty(0, np.float32)
        self.view.release()
        with contextlib.suppress(BufferError):  # a view still in use: unmapped when it goes
            self._map.close()


class SharedMemoryBudget:
    """Bytes of shared memory every local connection together may have attached: `configured`
    (--max-shared-memory, bytes), or when 0 settled at the first ATTACH, once θ's size is known:
    AUTO_REGIONS θ's, at most 1/AUTO_SHARE of `memory_budget` (--memory-budget-mb, bytes) or,
    without one, of what `probe` says the server may still use; at most PER_WORKER regions per
    worker. Reserved before a region is mapped, given back when it is closed."""

    def __init__(
        self,
        configured: int,
        metrics: ServerMetrics,
        memory_budget: int = 0,
        probe: Callable[[], Headroom | None] = headroom,
    ) -> None:
        self._metrics = metrics
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
        self.limit = AUTO_REGIONS * theta_bytes
        self.source = f"--max-shared-memory 0: {AUTO_REGIONS} θ's of {size(theta_bytes)}"
        if room is not None and room.bytes // AUTO_SHARE < self.limit:
            self.limit = max(0, room.bytes // AUTO_SHARE)
            self.source = f"--max-shared-memory 0: a quarter of {size(room.bytes)}, {room.source}"
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


def attach(fd: int, announced: int, expected: int, budget: SharedMemoryBudget, owner: str) -> SharedRegion:
    """Map the memfd `fd` announced as `announced` bytes, where θ's float32 bytes are `expected`,
    within `budget`, for a connection of the worker `owner`; InvalidArgument (the descriptor is
    not mapped) if it is not what a client may attach, ResourceExhausted past the budget. The
    descriptor is closed either way (the mapping keeps the memory)."""
    try:
        checked = _checked(fd, announced, expected)
        release = budget.reserve(checked, expected, owner)
        try:
            return SharedRegion(fd, checked, release)
        except BaseException:
            release()
            raise
    except OSError as error:
        raise InvalidArgument(f"shared memory could not be mapped: {error.strerror}", Reason.MALFORMED) from None
    finally:
        os.close(fd)


def _checked(fd: int, announced: int, expected: int) -> int:
    def refuse(why: str) -> InvalidArgument:
        return InvalidArgument(f"shared memory refused: {why}", Reason.MALFORMED)

    if announced != expected:
        raise refuse(f"{announced} bytes announced; θ's float32 bytes here are {expected}")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise refuse("not a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise refuse("not a memfd (it has no seals)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise refuse("not sealed against shrinking (F_SEAL_SHRINK)")
    if info.st_blksize != mmap.PAGESIZE:
        raise refuse(f"pages of {info.st_blksize} bytes (hugetlb?); ordinary pages only")
    if info.st_size != announced:
        raise refuse(f"{info.st_size} bytes, {announced} announced")
    written = info.st_blocks * 512  # the pages that exist: charged to whoever made them, its client
    if written < announced:
        raise refuse(
            f"{announced - written} of its {announced} bytes not written by the client yet (write it whole, or "
            "posix_fallocate it, before attaching: the server maps only memory its client holds)"
        )
    return announced


def _nothing() -> None:
    pass
