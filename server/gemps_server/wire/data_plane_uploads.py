"""Where a data-plane commit's payload is read, so that one worker's slow upload never makes
another's commit wait (issue 37, item 1; docs/RELIABILITY.md, "Slow uploads").

Two lanes of θ-sized buffers, each reused and handed out in arrival order:

- **the fast lane**, the --data-plane-buffers pool that every request takes first (a pull, or a
  shared-memory commit whose payload is in hand, only ever uses it). A payload read there must
  come at once: within UPLOAD_SLACK plus its bytes at FAST_FRACTION of the rate the server sees
  payloads on this lane arrive at (a moving average, `Lanes.rate`). That floor is relative: on
  loopback hundreds of MiB/s, on a 1 Gbit/s link tens. A worker whose last upload came so is
  proven; the others (a new registration, or one whose last upload was slow) hold at most a
  quarter of the pool at once (`NEWCOMER_SHARE`, at least one buffer) and wait in line for it
  holding nothing, so however many of them come and go, proven workers never wait behind them.
- **the slow lane**, --slow-upload-buffers of its own. A payload that misses its window moves
  there: the bytes it sent so far are copied over, its pooled buffer goes back at once, and the
  upload goes on at its own pace (held only to --min-stream-rate-mb, like any transfer); it is
  applied and answered from that buffer. With no slow-lane buffer free it is refused
  (DEADLINE_EXCEEDED, stream_idle: the SDK retries), never kept on the fast lane.

A request arrives when its payload is complete in the server's memory, and requests are applied
in arrival order (the service is called when the last byte is in).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import DeadlineExceeded
from gemps_server.wire.data_plane_io import Hangup, Stalled, Unread
from gemps_server.wire.data_plane_loop import Parked, ReadInto, Task, Wait
from gemps_server.wire.reply_budget import ReplyBudget
from gemps_server.wire.stream_buffers import Buffer
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
# The part of the fast lane that requests of workers not proven fast may hold at once.
NEWCOMER_SHARE = 0.25

# A connection waiting for a buffer: called with one when it is its turn (None: give up).
Grant = Callable[[Buffer | None], None]


class Lane:
    """`count` buffers, each allocated once and reused, handed to waiting connections in arrival
    order (first come, first served: under load, a freed buffer taken by a newcomer ahead of those
    waiting starved some clients of turns). Requests marked `newcomer` hold at most `share` of
    them at once; past it they wait, and those behind them that may take one do."""

    def __init__(self, count: int, share: int | None = None) -> None:
        if count < 1:
            raise ValueError(f"a lane needs at least one buffer, not {count}")
        self._free: list[np.ndarray] = [np.empty(0, np.uint8) for _ in range(count)]
        self._waiting: collections.deque[tuple[Grant, bool]] = collections.deque()
        self._share = count if share is None else share
        self._newcomers = 0  # buffers newcomers hold now

    def _may_take(self, newcomer: bool) -> bool:
        return bool(self._free) and (not newcomer or self._newcomers < self._share)

    def take(self, grant: Grant, newcomer: bool = False) -> Buffer | None:
        """A buffer now; or None, and `grant` is called with one when it is this caller's turn.
        (No caller that may take one waits while one is free: each give_back hands them out.)"""
        if self._may_take(newcomer):
            self._newcomers += newcomer
            return Buffer(self._free.pop())
        self._waiting.append((grant, newcomer))
        return None

    def withdraw(self, grant: Grant) -> None:
        """A waiting caller leaves the line (nothing happens if it is not in it)."""
        for entry in self._waiting:
            if entry[0] is grant:
                self._waiting.remove(entry)
                return

    def give_back(self, buffer: Buffer, newcomer: bool = False) -> None:
        self._newcomers -= newcomer
        self._free.append(buffer.bytes)
        for entry in list(self._waiting):  # the longest waiting that may take one
            if not self._free:
                return
            grant, waiter_is_newcomer = entry
            if self._may_take(waiter_is_newcomer):
                self._waiting.remove(entry)
                self._newcomers += waiter_is_newcomer
                grant(Buffer(self._free.pop()))

    def turn_away(self) -> None:
        """Every caller still waiting gets None (the server is stopping)."""
        while self._waiting:
            self._waiting.popleft()[0](None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


@dataclass
class Held:
    """A buffer and the lane it goes back to (once: a reply moved out of it gives it back early,
    data_plane_replies.py, and its request's end does again)."""

    buffer: Buffer
    lane: Lane
    newcomer: bool = False
    returned: bool = False

    def give_back(self) -> None:
        if not self.returned:
            self.returned = True
            self.lane.give_back(self.buffer, self.newcomer)


def waited(lane: Lane, task: Task, newcomer: bool = False) -> Generator[Wait, Any, Held]:
    """A buffer of `lane`, waiting in line (Parked, holding nothing) while none may be taken;
    Hangup(None) (closed unanswered: the client retries) when the server stops first."""

    def granted(buffer: Buffer | None) -> None:  # the lane's answer, handed over on the loop
        def hand_over() -> None:
            if task.done:  # ended before it got it
                if buffer is not None:
                    lane.give_back(buffer, newcomer)
            else:
                task.resume(buffer)

        task.loop.call_soon(hand_over)

    buffer = lane.take(granted, newcomer)
    if buffer is None:
        try:
            buffer = yield Parked()
        finally:
            lane.withdraw(granted)  # ended while waiting (a no-op once granted)
    if buffer is None:
        raise Hangup(None)
    return Held(buffer, lane, newcomer)


class Lanes:
    """The two lanes, the observed rate and the workers proven fast, and the bytes that replies
    to lagging readers pin (`replies`, --max-reply-mb: data_plane_replies.py), on the loop's
    thread only."""

    def __init__(self, pooled: int, slow: int, max_proven: int, reply_bytes: int = 128 << 20) -> None:
        self.pooled = Lane(pooled, share=max(1, int(pooled * NEWCOMER_SHARE)))
        self.slow = Lane(slow)
        self.replies = ReplyBudget(reply_bytes)
        self.rate = INITIAL_RATE  # bytes/s of fast-lane payloads, a moving average
        self._proven: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max_proven = max_proven  # --max-workers: the oldest, likely gone, forgotten first

    def window(self, nbytes: int) -> float:
        """Seconds a fast-lane payload of `nbytes` may take."""
        return UPLOAD_SLACK + nbytes / (FAST_FRACTION * self.rate)

    def turn_away(self) -> None:
        """The server is stopping: everyone waiting for a buffer of either lane gets None."""
        self.pooled.turn_away()
        self.slow.turn_away()

    def receive(self, task: Task, worker_id: str, data_bytes: int, pace: Pace) -> Generator[Wait, Any, Held]:
        """A buffer holding the commit payload of `data_bytes` that follows on `task`'s socket,
        read whole (the caller gives it back). Stalled as any read; Unread when it is too slow for
        the fast lane and the slow lane has no room."""
        held = yield from waited(self.pooled, task, newcomer=worker_id not in self._proven)
        return (yield from self._fast(held, worker_id, data_bytes, pace))

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
        self._proven[worker_id] = None  # it came at once: a place of its own in line from now on
        self._proven.move_to_end(worker_id)
        while len(self._proven) > self._max_proven:
            self._proven.popitem(last=False)
        return held

    def _to_slow_lane(
        self, held: Held, worker_id: str, view: memoryview, read: ReadInto, paced: float
    ) -> Generator[Wait, Any, Held]:
        """Move an upload that missed its window: its bytes so far into a slow-lane buffer (the
        pooled one `held` goes back now), the rest read there by the pace's deadline."""
        self._proven.pop(worker_id, None)  # its next upload waits for a newcomer's place
        buffer = self.slow.take(_never)
        if buffer is None:  # none free now (or others wait for one): refused, never kept here
            self.slow.withdraw(_never)
            held.give_back()
            raise Unread(
                DeadlineExceeded(
                    f"payload slower than a quarter of the rate at which others arrive ({self.rate / (1 << 20):.0f} "
                    "MiB/s), and every slow-upload buffer is taken (--slow-upload-buffers): retry",
                    Reason.STREAM_IDLE,
                ),
                refusal="slow_upload",
            )
        slow, filled = Held(buffer, self.slow), read.filled
        moved = _view(slow, len(view))
        moved[:filled] = view[:filled]
        held.give_back()
        try:
            yield ReadInto(moved[filled:], read.stall, paced)
        except BaseException:
            slow.give_back()
            raise
        return slow


def _view(held: Held, nbytes: int) -> memoryview:
    return held.buffer.take(nbytes).data


def _never(_buffer: Buffer | None) -> None:
    """The grant of a take that is withdrawn at once: never called."""
