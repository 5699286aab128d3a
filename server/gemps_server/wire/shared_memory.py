"""Shared memory a local data-plane client attaches (DataPlaneAttach, gemps_proto/data_plane_frames.py).

The client makes a memfd of θ's float32 size, writes it whole (or posix_fallocates it), seals it
against shrinking, maps it, and passes it over its Unix socket; the server maps it, seals it
against new writable mappings and hole punching, and from then on reads that client's payloads
from it and writes the replies' θ into it.

Whose memory it is (issue 42, item 6): a page of a memfd is charged (its cgroup's memory) to the
process that first makes it exist. A memfd its client never wrote has no pages yet, so the
server's first reply made them all, in the server's cgroup: 200 such connections at P = 1M added
800 MiB to the server. So a memfd is mapped only when every page of it exists (st_blocks covers
its size), and once mapped the server seals it F_SEAL_FUTURE_WRITE: from then on no one can free
a page of it (fallocate PUNCH_HOLE and madvise MADV_REMOVE fail with EPERM) nor map it writable
again, while the client's mapping and the server's still write; the pages are checked again after
the seal (one freed before it would otherwise be made by the server). Every page the server
touches is then its client's, for as long as it is mapped. What the server's RSS shows of them
(RssShmem; the OOM killer counts it) is bounded by shared_memory_budget.py: past it an ATTACH is
refused RESOURCE_EXHAUSTED (shared_memory_limit) and that client sends θ on its socket.

On a kernel without F_SEAL_FUTURE_WRITE (before Linux 5.1) the pages are checked at ATTACH only:
a client that frees them later makes the server's next reply fault them in, charged to the
server, at most the budget.

Trust (DESIGN §3b): a descriptor is mapped only when it is a memfd (it has seals), sealed against
shrinking (a file cut short under a mapping would kill this process with SIGBUS on the next read)
but not against further seals or writing, of ordinary pages (hugetlb pages can run out), readable
and writable, exactly the size announced and expected, and written whole. The client can still
write into the memory at any time, so a payload is copied out before it is checked (see
data_plane_calls.Connection._commit), never used in place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Callable

import numpy as np

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import InvalidArgument
from gemps_server.wire.shared_memory_budget import SharedMemoryBudget
from gemps_server.wire.stream_buffers import Buffer

# Linux 5.1's seal (not named by every Python's fcntl): no new writable mapping, no write(), and
# no hole punched (fallocate PUNCH_HOLE, madvise MADV_REMOVE), while the existing mappings (the
# client's, the server's) still write.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


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


def attach(fd: int, announced: int, expected: int, budget: SharedMemoryBudget, owner: str) -> SharedRegion:
    """Map the memfd `fd` announced as `announced` bytes, where θ's float32 bytes are `expected`,
    within `budget`, for a connection of the worker `owner`; InvalidArgument (the descriptor is
    not mapped) if it is not what a client may attach, ResourceExhausted past the budget. The
    descriptor is closed either way (the mapping keeps the memory)."""
    try:
        checked = _checked(fd, announced, expected)
        release = budget.reserve(checked, expected, owner)
        region = None
        try:
            region = SharedRegion(fd, checked, release)
            _keep_pages(fd, checked)
            return region
        except BaseException:
            (release if region is None else region.close)()  # the bytes go back either way
            raise
    except OSError as error:
        raise InvalidArgument(f"shared memory could not be mapped: {error.strerror}", Reason.MALFORMED) from None
    finally:
        os.close(fd)


def _refuse(why: str) -> InvalidArgument:
    return InvalidArgument(f"shared memory refused: {why}", Reason.MALFORMED)


def _checked(fd: int, announced: int, expected: int) -> int:
    refuse = _refuse
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
    if seals & (fcntl.F_SEAL_SEAL | fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise refuse(
            "sealed against further seals or writing (the server maps it writable, then seals it against hole "
            "punching itself: F_SEAL_FUTURE_WRITE)"
        )
    if info.st_blksize != mmap.PAGESIZE:
        raise refuse(f"pages of {info.st_blksize} bytes (hugetlb?); ordinary pages only")
    if info.st_size != announced:
        raise refuse(f"{info.st_size} bytes, {announced} announced")
    _written(info, announced)
    return announced


def _written(info: os.stat_result, announced: int) -> None:
    """InvalidArgument unless every page exists (its client's: charged to whoever made it)."""
    written = info.st_blocks * 512
    if written < announced:
        raise _refuse(
            f"{announced - written} of its {announced} bytes not written by the client yet (write it whole, or "
            "posix_fallocate it, then map it, before attaching: the server maps only memory its client holds)"
        )


def _keep_pages(fd: int, announced: int) -> None:
    """Mapped: seal it so that no page can be freed any more (nor a new writable mapping made),
    then check again that every page exists. InvalidArgument if the client sealed it meanwhile."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError as error:
        if error.errno != errno.EINVAL:  # EINVAL: a kernel before 5.1, checked at ATTACH only
            raise _refuse(f"could not be sealed against hole punching: {error.strerror}") from None
    _written(os.fstat(fd), announced)


def _nothing() -> None:
    pass
