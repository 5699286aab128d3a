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
from collections import deque
from collections.abc import AsyncIterator, Callable

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


# A connection waiting for a buffer: called with one when it is its turn (None: give up).
Grant = Callable[["Buffer | None"], None]


class LoopBufferPool:
    """BufferPool for the data plane's loop (one thread): `count` buffers, each reused, handed to
    waiting connections in arrival order (first come, first served: under load, a freed buffer
    taken by a newcomer ahead of those waiting starved some clients of turns)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a buffer pool needs at least one buffer, not {count}")
        self._free: list[np.ndarray] = [np.empty(0, np.uint8) for _ in range(count)]
        self._waiting: deque[Grant] = deque()

    def take(self, grant: Grant) -> Buffer | None:
        """A buffer now; or None, and `grant` is called with one when it is this caller's turn."""
        if self._free and not self._waiting:
            return Buffer(self._free.pop())
        self._waiting.append(grant)
        return None

    def withdraw(self, grant: Grant) -> None:
        """A waiting caller leaves the line (nothing happens if it is not in it)."""
        with contextlib.suppress(ValueError):
            self._waiting.remove(grant)

    def give_back(self, buffer: Buffer) -> None:
        if self._waiting:
            self._waiting.popleft()(buffer)
        else:
            self._free.append(buffer.bytes)

    def turn_away(self) -> None:
        """Every caller still waiting gets None (the server is stopping)."""
        while self._waiting:
            self._waiting.popleft()(None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


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
        """`data` copied into the buffer's first bytes, as a view of them."""
        source = np.frombuffer(data, np.uint8)
        target = self.take(source.nbytes)
        target[:] = source
        return target.data
