"""The single FIFO applier: state-changing operations run one at a time, in arrival order.

gRPC handlers (on the asyncio event loop) and the data plane's loop submit operations;
one dedicated thread runs them in the order they were submitted and hands each result back to
its submitter (the handler's future, or a callback). The math runs off the event loop, so
network I/O for other requests overlaps it, and no worker can be starved: there is no polling
order, only the queue.
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
    cpu_seconds: float = 0.0  # the running thread's CPU time (the wall time less what others took of the core)


@dataclass(frozen=True)
class Timed(Generic[T]):
    result: T
    timing: Timing


# Called after each operation, on the thread that ran it, with its run and CPU seconds (the
# utilisation metric).
Observer = Callable[[float, float], None]
# Hands an outcome (or the exception that refused it) to whoever submitted it, not waiting for it.
Deliver = Callable[[T | None, BaseException | None], None]

_Item = tuple[Callable[[], Any], "Deliver[Timed[Any]]", float]


class ApplierStopped(RuntimeError):
    """An operation submitted from a thread after the applier stopped: it will never run."""


def _settle(future: asyncio.Future[Timed[Any]], outcome: Timed[Any] | None, error: BaseException | None) -> None:
    if future.done():  # the handler was cancelled (client went away): nothing to deliver
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)  # type: ignore[arg-type]


def _to_future(future: asyncio.Future[Timed[Any]], loop: asyncio.AbstractEventLoop) -> Deliver[Timed[Any]]:
    def deliver(outcome: Timed[Any] | None, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # event loop closed: the server is shutting down
            loop.call_soon_threadsafe(_settle, future, outcome, error)

    return deliver


class Applier:
    def __init__(self, observer: Observer | None = None) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="gemps-applier", daemon=True)
        # Operations submitted and not finished; an inline one runs only when this is 0, so it is
        # never overtaken by, nor overtakes, anything submitted before it.
        self._pending = 0
        self._pending_lock = threading.Lock()
        # Held while any operation runs, on whichever thread: inline runs come from the event
        # loop and from the data plane's loop at once, and the applier's thread may pick up the next
        # queued operation while an inline one still runs. Order comes from _pending, exclusion
        # from this lock.
        self._running = threading.Lock()
        self._accepting_inline = False
        self._stopped = False

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
        microseconds: most of a small commit's cost). Still one at a time and in order (see
        _claim_idle). For short operations only: it holds the event loop.
        """
        if inline and self._claim_idle():
            return self._run_inline(operation)
        with self._pending_lock:
            self._pending += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Timed[T]] = loop.create_future()
        self._queue.put((operation, _to_future(future, loop), time.perf_counter()))
        return await future

    def submit_then(self, operation: Callable[[], T], deliver: Deliver[Timed[T]], inline: bool = False) -> None:
        """Run `operation` after everything submitted before it and hand its Timed outcome (or its
        exception) to `deliver`: on the calling thread when it ran `inline` (as in submit_timed),
        else on the applier's thread. For a caller that does not wait: the data plane's loop."""
        if self._stopped:
            raise ApplierStopped("the applier has stopped: the server is shutting down")
        if inline and self._claim_idle():
            try:
                timed = self._run_inline(operation)
            except Exception as error:
                deliver(None, error)
                return
            deliver(timed, None)
            return
        with self._pending_lock:
            self._pending += 1
        self._queue.put((operation, deliver, time.perf_counter()))

    def _claim_idle(self) -> bool:
        """Count an inline operation as pending if nothing else is; False when something is."""
        if not self._accepting_inline:
            return False
        with self._pending_lock:
            if self._pending:
                return False
            self._pending = 1
            return True

    def _run_inline(self, operation: Callable[[], T]) -> Timed[T]:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            with self._running:
                result = operation()
        finally:
            with self._pending_lock:
                self._pending -= 1
        timing = Timing(0.0, time.perf_counter() - started, time.thread_time() - cpu)
        if self._observer is not None:
            self._observer(timing.run_seconds, timing.cpu_seconds)
        return Timed(result, timing)

    def stop(self) -> None:
        """Run what is queued, then end the thread."""
        self._accepting_inline = False
        self._stopped = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._execute(*item)
            # Dropped now: kept, it (a commit and its reply, θ-sized) would live on while the thread waits.
            item = None

    def _execute(self, operation: Callable[[], Any], deliver: Deliver[Timed[Any]], queued_at: float) -> None:
        result: Any = None
        error: BaseException | None = None
        with self._running:  # an inline operation claimed before this was queued may still run
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                result = operation()
            except Exception as exc:  # delivered to whoever submitted it
                error = exc
            timing = Timing(started - queued_at, time.perf_counter() - started, time.thread_time() - cpu)
        with self._pending_lock:
            self._pending -= 1
        if self._observer is not None:
            self._observer(timing.run_seconds, timing.cpu_seconds)
        outcome = Timed(result, timing) if error is None else None
        result = None  # nothing of it held here once delivered
        deliver(outcome, error)
