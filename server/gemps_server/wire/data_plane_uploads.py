"""Where a data-plane commit's payload is read, so that one worker's slow upload never makes
another's commit wait (issue 37, item 1; docs/RELIABILITY.md, "Slow uploads").

Two lanes of θ-sized buffers, each reused and handed out in arrival order:

- **the fast lane**, the --data-plane-buffers pool that every request takes first (and the one a
  pull or a shared-memory commit, whose payload is in hand, only ever uses). A payload read there
  must come at once: within UPLOAD_SLACK plus its bytes at a quarter of the rate the server sees
  payloads on this lane arrive (a moving average, `Lanes.rate`). That floor is relative: on
  loopback it is hundreds of MiB/s, on a 1 Gbit/s link tens.
- **the slow lane**, --slow-upload-buffers of its own. A payload that misses its window moves
  there: the bytes it sent so far are copied over, the pooled buffer goes back to whoever waits
  for it, and the upload goes on at its own pace (held only to --min-stream-rate-mb, like any
  transfer); it is applied and answered from that buffer. Its worker is marked slow: its next
  uploads wait for a slow-lane buffer, holding nothing (their bytes stay in the kernel), until one
  of them arrives at the fast lane's pace. With no slow-lane buffer free at that moment, the
  upload is refused (DEADLINE_EXCEEDED, stream_idle: the SDK retries, and the retry waits on the
  slow lane), never kept on the fast lane.

So a slow uploader holds a pooled buffer once per worker id for at most its window, and then only
slow-lane memory: the pool stays with the payloads that arrive at once. A request arrives when its
payload is complete in the server's memory, and requests are applied in arrival order (the
service is called when the last byte is in).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import DeadlineExceeded
from gemps_server.wire.data_plane_io import Hangup, Stalled, Unread
from gemps_server.wire.data_plane_loop import Parked, ReadInto, Task, Wait
from gemps_server.wire.stream_buffers import Buffer, LoopBufferPool
from gemps_server.wire.streams import Pace

# A fast-lane payload's window: this much slack (a loaded host's scheduling, the first round
# trip) plus its bytes at FAST_FRACTION of the observed rate.
UPLOAD_SLACK = 0.25
FAST_FRACTION = 0.25
# The rate assumed before any payload was measured (about a 1 Gbit/s link), and how much each
# new measurement moves the average. Payloads below MEASURED_BYTES are not measured: their time
# is a system call's, not the link's.
INITIAL_RATE = 100.0 * (1 << 20)
RATE_WEIGHT = 1 / 8
MEASURED_BYTES = 256 << 10


@dataclass
class Held:
    """A buffer and the lane it goes back to."""

    buffer: Buffer
    pool: LoopBufferPool

    def give_back(self) -> None:
        self.pool.give_back(self.buffer)


def waited(pool: LoopBufferPool, task: Task) -> Generator[Wait, Any, Held]:
    """A buffer of `pool`, waiting in line (Parked, holding nothing) while all are in use;
    Hangup(None) (closed unanswered: the client retries) when the server stops first."""

    def granted(buffer: Buffer | None) -> None:  # the pool's answer, handed over on the loop
        def hand_over() -> None:
            if task.done:  # ended before it got it
                if buffer is not None:
                    pool.give_back(buffer)
            else:
                task.resume(buffer)

        task.loop.call_soon(hand_over)

    buffer = pool.take(granted)
    if buffer is None:
        try:
            buffer = yield Parked()
        finally:
            pool.withdraw(granted)  # ended while waiting (a no-op once granted)
    if buffer is None:
        raise Hangup(None)
    return Held(buffer, pool)


class Lanes:
    """The two lanes, the observed rate and the workers marked slow (on the loop's thread only)."""

    def __init__(self, pooled: int, slow: int, max_marks: int) -> None:
        self.pooled = LoopBufferPool(pooled)
        self.slow = LoopBufferPool(slow)
        self.rate = INITIAL_RATE  # bytes/s of fast-lane payloads, a moving average
        self._marked: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max_marks = max_marks  # --max-workers: the marks of workers gone are dropped first
        self.moved = 0  # uploads moved to the slow lane, for tests and logs

    def window(self, nbytes: int) -> float:
        """Seconds a fast-lane payload of `nbytes` may take."""
        return UPLOAD_SLACK + nbytes / (FAST_FRACTION * self.rate)

    def slow_worker(self, worker_id: str) -> bool:
        return worker_id in self._marked

    def turn_away(self) -> None:
        """The server is stopping: everyone waiting for a buffer of either lane gets None."""
        self.pooled.turn_away()
        self.slow.turn_away()

    def receive(self, task: Task, worker_id: str, data_bytes: int, pace: Pace) -> Generator[Wait, Any, Held]:
        """A buffer holding the commit payload of `data_bytes` that follows on `task`'s socket,
        read whole (the caller gives it back). Stalled as any read; Unread when it is too slow for
        the fast lane and the slow lane has no room."""
        if worker_id in self._marked:
            held = yield from waited(self.slow, task)
            try:
                began = time.monotonic()
                yield ReadInto(_view(held, data_bytes), pace.idle_timeout, began + pace.allowance(data_bytes))
            except BaseException:
                held.give_back()
                raise
            if time.monotonic() - began <= self.window(data_bytes):
                self._marked.pop(worker_id, None)  # it keeps up again: back to the fast lane
            return held
        return (yield from self._fast((yield from waited(self.pooled, task)), worker_id, data_bytes, pace))

    def _fast(self, held: Held, worker_id: str, data_bytes: int, pace: Pace) -> Generator[Wait, Any, Held]:
        """Read into the pooled buffer `held` within the window; past it, on the slow lane. What is
        not returned is given back, however this ends."""
        began = time.monotonic()
        paced, window = began + pace.allowance(data_bytes), began + self.window(data_bytes)
        view = _view(held, data_bytes)
        read = ReadInto(view, pace.idle_timeout, min(paced, window))
        try:
            yield read
        except Stalled:
            now = time.monotonic()
            if now >= paced or now - read.moved_at >= pace.idle_timeout:
                held.give_back()
                raise  # stalled, or slower than the floor itself
            return (yield from self._to_slow_lane(held, worker_id, view, read, paced))
        except BaseException:
            held.give_back()
            raise
        if data_bytes >= MEASURED_BYTES:
            seconds = max(time.monotonic() - began, 1e-6)
            self.rate += RATE_WEIGHT * (data_bytes / seconds - self.rate)
        return held

    def _to_slow_lane(
        self, held: Held, worker_id: str, view: memoryview, read: ReadInto, paced: float
    ) -> Generator[Wait, Any, Held]:
        """Move an upload that missed its window: its bytes so far into a slow-lane buffer (the
        pooled one `held` goes back now), the rest read there by the pace's deadline."""
        self._mark(worker_id)
        buffer = self.slow.take(_never)
        if buffer is None:  # none free now (or others wait for one): refused, never kept here
            self.slow.withdraw(_never)
            held.give_back()
            raise Unread(
                DeadlineExceeded(
                    f"payload slower than a quarter of the rate others' arrive at ({self.rate / (1 << 20):.0f} "
                    "MiB/s), and every slow-upload buffer is taken (--slow-upload-buffers): retry",
                    Reason.STREAM_IDLE,
                ),
                refusal="slow_upload",
            )
        slow, filled = Held(buffer, self.slow), read.filled
        moved = _view(slow, len(view))
        moved[:filled] = view[:filled]
        held.give_back()
        self.moved += 1
        try:
            yield ReadInto(moved[filled:], read.stall, paced)
        except BaseException:
            slow.give_back()
            raise
        return slow

    def _mark(self, worker_id: str) -> None:
        self._marked[worker_id] = None
        self._marked.move_to_end(worker_id)
        while len(self._marked) > self._max_marks:
            self._marked.popitem(last=False)


def _view(held: Held, nbytes: int) -> memoryview:
    return held.buffer.take(nbytes).data


def _never(_buffer: Buffer | None) -> None:
    """The grant of a take that is withdrawn at once: never called."""
