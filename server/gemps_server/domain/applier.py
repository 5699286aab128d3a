"""The single FIFO applier: state-changing operations run one at a time, in arrival order.

gRPC handlers (on the asyncio event loop) submit operations; one dedicated thread runs them in
the order they were submitted and hands each result back to its handler's future. The math
runs off the event loop, so network I/O for other requests overlaps it, and no worker can be
starved: there is no polling order, only the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """Where an operation's time went: waiting in the FIFO queue, then running."""

    queued_seconds: float
    run_seconds: float


@dataclass(frozen=True)
class Timed(Generic[T]):
    result: T
    timing: Timing


# Called on the applier thread after each operation (the utilisation metric).
Observer = Callable[[Timing], None]

_Item = tuple[Callable[[], Any], "asyncio.Future[Timed[Any]]", asyncio.AbstractEventLoop, float]


def _settle(future: asyncio.Future[Timed[Any]], outcome: Timed[Any] | None, error: BaseException | None) -> None:
    if future.done():  # the handler was cancelled (client went away): nothing to deliver
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)  # type: ignore[arg-type]


class Applier:
    def __init__(self, observer: Observer | None = None) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="gemps-applier", daemon=True)
        # Operations submitted and not finished; an inline one runs only when this is 0.
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._accepting_inline = False

    @property
    def depth(self) -> int:
        """Operations waiting to run (not counting the one running)."""
        return self._queue.qsize()

    def start(self) -> None:
        self._thread.start()
        self._accepting_inline = True

    async def submit(self, operation: Callable[[], T]) -> T:
        """Run `operation` after everything submitted before it; its result (or exception)."""
        return (await self.submit_timed(operation)).result

    async def submit_timed(self, operation: Callable[[], T], inline: bool = False) -> Timed[T]:
        """submit(), with how long the operation waited and ran (measured here, once).

        `inline`: when nothing is queued or running, run it right here on the event loop instead
        of handing it to the applier's thread and back (two thread wake-ups, tens of
        microseconds: most of a small commit's cost). Still one at a time and in order: the
        applier's thread cannot start anything while it runs, and nothing else can be submitted
        from this loop meanwhile. For short operations only: it holds the event loop.
        """
        if inline and self._accepting_inline:
            with self._pending_lock:
                idle = self._pending == 0
                if idle:
                    self._pending = 1
            if idle:
                return self._run_inline(operation)
        with self._pending_lock:
            self._pending += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Timed[T]] = loop.create_future()
        self._queue.put((operation, future, loop, time.perf_counter()))
        return await future

    def _run_inline(self, operation: Callable[[], T]) -> Timed[T]:
        started = time.perf_counter()
        try:
            result = operation()
        finally:
            with self._pending_lock:
                self._pending -= 1
        timing = Timing(0.0, time.perf_counter() - started)
        if self._observer is not None:
            self._observer(timing)
        return Timed(result, timing)

    def stop(self) -> None:
        """Run what is queued, then end the thread."""
        self._accepting_inline = False
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._execute(*item)
            # Dropped now: kept, it (a commit and its reply, θ-sized) would live on while the thread waits.
            item = None

    def _execute(
        self,
        operation: Callable[[], Any],
        future: asyncio.Future[Any],
        loop: asyncio.AbstractEventLoop,
        queued_at: float,
    ) -> None:
        started = time.perf_counter()
        result: Any = None
        error: BaseException | None = None
        try:
            result = operation()
        except Exception as exc:  # delivered to the handler that submitted it
            error = exc
        timing = Timing(started - queued_at, time.perf_counter() - started)
        with self._pending_lock:
            self._pending -= 1
        if self._observer is not None:
            self._observer(timing)
        with contextlib.suppress(RuntimeError):  # event loop closed: the server is shutting down
            loop.call_soon_threadsafe(_settle, future, Timed(result, timing), error)
