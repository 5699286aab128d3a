"""The θ-sized buffers CommitStream works in: a few, allocated once and reused.

A streamed commit needs one buffer of about 4P bytes: its payload is assembled in it and, once
applied, the reply's θ is copied into the same bytes and sent from there. Taking those buffers
from a pool of `count` means at most `count` streams hold memory here (the others wait in gRPC
flow control) and no commit allocates, faults in and frees 4P bytes of its own: freed buffers
of that size scatter over the heap, which cannot return them to the kernel while anything
above them is in use (10M parameters, 8 clients: 170 MB of free but resident heap before).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np


class BufferPool:
    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a buffer pool needs at least one buffer, not {count}")
        self._available = asyncio.Semaphore(count)
        self._free: list[np.ndarray] = []

    @contextlib.asynccontextmanager
    async def buffer(self) -> AsyncIterator[Buffer]:
        """A buffer for one stream, waiting while all `count` are in use; back to the pool on exit."""
        async with self._available:
            buffer = Buffer(self._free.pop() if self._free else np.empty(0, np.uint8))
            try:
                yield buffer
            finally:
                self._free.append(buffer.bytes)


class Buffer:
    """One pooled buffer, grown (once) to what a stream asks of it."""

    def __init__(self, array: np.ndarray) -> None:
        self.bytes = array

    def take(self, nbytes: int) -> np.ndarray:
        """The buffer's first `nbytes` bytes, writable (the buffer grows if it is smaller)."""
        if self.bytes.nbytes < nbytes:
            self.bytes = np.empty(nbytes, np.uint8)  # not zeroed: callers write before they read
        return self.bytes[:nbytes]

    def copy_in(self, data: bytes | memoryview) -> memoryview:
        """`data` copied into the buffer's first bytes, as a view of them; no copy when `data`
        already is those bytes (θ written there by the rule)."""
        source = np.frombuffer(data, np.uint8)
        target = self.take(source.nbytes)
        # __array_interface__, not .ctypes: the same address, without building a ctypes object
        if source.__array_interface__["data"][0] != target.__array_interface__["data"][0]:
            target[:] = source
        return target.data
