"""Shared memory a local data-plane client attaches (DataPlaneAttach, gemps_proto/data_plane_frames.py).

The client makes a memfd of θ's float32 size, seals it against shrinking, and passes it over its
Unix socket; the server maps it and from then on reads that client's payloads from it and writes
the replies' θ into it. The memory is the client's: it wrote it first, so its pages are counted to
the client, and what it can make this process hold is one θ-sized mapping per connection.

Trust (DESIGN §3b): a descriptor is mapped only when it is a memfd (it has seals), sealed against
shrinking (a file cut short under a mapping would kill this process with SIGBUS on the next read),
of ordinary pages (hugetlb pages can run out), readable and writable, and exactly the size
announced and expected. The client can still write into the memory at any time, so a payload is
copied out before it is checked (see data_plane_calls.Connection._commit), never used in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat

import numpy as np

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import InvalidArgument
from gemps_server.wire.stream_buffers import Buffer


class SharedRegion:
    """An attached memfd, mapped read-write: `view` is its bytes, `buffer` the same bytes as a
    reply writer's target (stream_buffers.Buffer), `floats` as float32 (where a rule writes θ)."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self._map)
        self.buffer = Buffer(np.frombuffer(self._map, np.uint8))
        self.floats = np.frombuffer(self._map, np.float32)  # θ's float32 values, as a rule's mirror

    def close(self) -> None:
        """Unmap it (once nothing uses it any more: a reply may still be reading from a view)."""
        self.buffer = Buffer(np.empty(0, np.uint8))
        self.floats = np.empty(0, np.float32)
        self.view.release()
        with contextlib.suppress(BufferError):  # a view still in use: unmapped when it goes
            self._map.close()


def attach(fd: int, announced: int, expected: int) -> SharedRegion:
    """Map the memfd `fd` announced as `announced` bytes, where θ's float32 bytes are `expected`;
    InvalidArgument (the descriptor is not mapped) if it is not what a client may attach. The
    descriptor is closed either way (the mapping keeps the memory)."""
    try:
        return SharedRegion(fd, _checked(fd, announced, expected))
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
    return announced
