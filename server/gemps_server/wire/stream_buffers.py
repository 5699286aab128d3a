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
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

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


class _Waiter:
    """A connection thread waiting for a buffer: the pool hands one to it directly."""

    def __init__(self) -> None:
        self.granted = threading.Event()
        self.array: np.ndarray | None = None


class ThreadBufferPool:
    """BufferPool for the data plane's connection threads: `count` buffers, each reused, handed
    to waiting threads in arrival order (a semaphore lets a newcomer take a freed buffer ahead of
    threads already waiting: under load that starved some clients of turns)."""

    # How often a thread waiting for a buffer checks whether it should give up (shutdown).
    POLL_SECONDS = 0.25

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a buffer pool needs at least one buffer, not {count}")
        self._free: list[np.ndarray] = [np.empty(0, np.uint8) for _ in range(count)]
        self._waiting: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def buffer(self, give_up: Callable[[], bool]) -> Iterator[Buffer | None]:
        """A buffer, waiting (in order) while all are in use; None if `give_up()` turned true first."""
        array = self._take(give_up)
        if array is None:
            yield None
            return
        buffer = Buffer(array)
        try:
            yield buffer
        finally:
            self._give_back(buffer.bytes)

    def _take(self, give_up: Callable[[], bool]) -> np.ndarray | None:
        with self._lock:
            if self._free and not self._waiting:
                return self._free.pop()
            waiter = _Waiter()
            self._waiting.append(waiter)
        while not waiter.granted.wait(self.POLL_SECONDS):
            if give_up():
                with self._lock:
                    if waiter.array is None:  # not granted meanwhile: leave the line
                        self._waiting.remove(waiter)
                        return None
                break
        return waiter.array

    def _give_back(self, array: np.ndarray) -> None:
        with self._lock:
            if not self._waiting:
                self._free.append(array)
                return
            waiter = self._waiting.popleft()
            waiter.array = array
        waiter.granted.set()


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
