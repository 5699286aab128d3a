"""One call to each server process of a partitioned θ, at the same time.

A transport's `start_*` sends its request and returns what reads the reply (gemps.transport.Pending).
Over gRPC the send is itself asynchronous, and through shared memory it is a copy. But the data
plane over TCP writes the whole payload before `start_*` returns, and reads a reply only when asked:
started in turn, partition 1's upload began when partition 0's had left, and its reply waited in
the kernel's buffers while partition 0's was read. Between hosts, where each partition has a link
of its own, K partitions then moved a commit no faster than one link (1 Gbit/s, 10M parameters:
K = 4 gave 2.1x K = 1's commits/s, not 4x). So where a call moves more than a link's buffers hold,
each partition's exchange runs whole on a thread of its own (daemon threads kept for the client's
life: a blocked read never holds up the interpreter's exit); a small call stays on the caller's
thread, where a thread's hand-off would cost more than it saves.

The same threads carry a commit's per-partition work on either side of its calls (`each`): each
slice coded, each reply read into its copy (at 85M parameters, int8 both ways and 4 partitions,
most of a worker's CPU a commit: in numpy, whose passes let go of the GIL).
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from gemps import errors
from gemps.transport import Pending

T = TypeVar("T")

#: bytes a call moves (its payload or the θ its reply may carry, all partitions together) from
#: which each partition's exchange gets a thread: more than a socket's buffers take in at once.
THREADED_BYTES = 1 << 20


class FanOut:
    """Calls to `count` servers at once; the threads it needs, started when first needed."""

    def __init__(self) -> None:
        self._inboxes: list[queue.SimpleQueue[Callable[[], None] | None]] = []

    def calls(
        self,
        count: int,
        start: Callable[[int], Pending[T]],
        blocking: Callable[[int], T],
        suspect: Callable[[int, errors.GempsError], None],
        *,
        nbytes: int,
    ) -> list[T | errors.GempsError]:
        """One call per server (by index; `count` of them, two or more), concurrently: start them
        all, then wait for each. A call that failed in a way worth another attempt is done again
        with `blocking` (retries, registering again) once `suspect` has been told; another failure
        takes its call's place in the list, so that what the other servers did is known. `nbytes`:
        what the call moves, which decides whether threads carry it."""
        if nbytes >= THREADED_BYTES:
            outcomes = [done.result() for done in self.each(count, lambda index: _outcome(start(index)), nbytes=nbytes)]
        else:
            outcomes = [_outcome(pending) for pending in [start(index) for index in range(count)]]
        results: list[T | errors.GempsError] = []
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, errors.GempsError) and errors.worth_another_attempt(outcome):
                suspect(index, outcome)  # its next call looks where the server is first
                try:
                    outcome = blocking(index)
                except errors.GempsError as again:
                    outcome = again
            results.append(outcome)
        return results

    def each(self, count: int, work: Callable[[int], T], *, nbytes: int) -> list[Future[T]]:
        """`work(index)` for each of `count` servers, all ended when this returns: each its own
        future, whose `result()` is its value or raises what it raised. Server 0's on this thread,
        each other's on one of ours (in this call's context: its deadline) where `nbytes`, what the
        work moves or reads, is THREADED_BYTES or more; else all on this thread, in turn."""
        threaded = count > 1 and nbytes >= THREADED_BYTES
        while threaded and len(self._inboxes) < count - 1:
            inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(inbox,), name="gemps-partition-call", daemon=True).start()
            self._inboxes.append(inbox)
        futures: list[Future[T]] = [Future() for _ in range(count)]
        if threaded:
            for index in range(1, count):
                work_there = functools.partial(_settle, futures[index], contextvars.copy_context(), work, index)
                self._inboxes[index - 1].put(work_there)
        for index in range(1 if threaded else count):  # here: server 0's, or every server's in turn
            _settle(futures[index], contextvars.copy_context(), work, index)
        for future in futures:
            future.exception()  # waits until it is done; raises nothing
        return futures

    def close(self) -> None:
        """Let the threads end (each after the exchange it may be carrying)."""
        for inbox in self._inboxes:
            inbox.put(None)
        self._inboxes = []


def _outcome(pending: Pending[T]) -> T | errors.GempsError:
    try:
        return pending.result()
    except errors.GempsError as error:
        return error


def _settle(future: Future[T], context: contextvars.Context, work: Callable[[int], T], index: int) -> None:
    try:
        future.set_result(context.run(work, index))
    except BaseException as error:  # a bug's exception reaches the caller's thread, not this one's end
        future.set_exception(error)


def _serve(inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while (work := inbox.get()) is not None:
        work()
