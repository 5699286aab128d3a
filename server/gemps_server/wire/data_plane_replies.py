"""How a data-plane reply is written, so that a peer that does not read it holds nothing honest
workers need (issue 42, item 5; docs/RELIABILITY.md, "Issue 42, item 5").

Measured before: 4 registered connections that pipelined PULLs of θ (P = 1M) and read nothing
each held a --data-plane-buffers buffer for the whole --stream-idle-timeout (30 s) while their
first reply did not fit in the socket's buffers, and an honest commit waited 29.6 s for one.
So a reply holds no pooled buffer while its reader lags:

- A pull's θ goes from the version's shared encoding, never through the pool; what such replies
  pin is bounded by the data plane's reply budget (--max-reply-mb, `Lanes.replies`), taken before
  the pull's snapshot (`reply_room`: waiting there pins no version, as on the gRPC port).
- A commit's θ is copied into its pooled buffer by the applier and written from there. A write
  still unfinished after its window (the fast lane's, data_plane_uploads.Lanes.window: slack
  plus its bytes at a quarter of the rate payloads arrive at) moves the rest out: copied into
  memory of its own, charged to the budget, and the buffer given back. With no room in the
  budget now, the connection is closed instead (the commit was applied: the SDK's retry, with
  its request id, gets its reply from the ledger).
- A connection whose reply is unread past its window while it has sent more requests (bytes
  waiting in its socket: an honest client reads each reply before it sends the next request) is
  closed, counted as unread_replies: its pipelined requests are never served.

Past the window a reply is held to the pace of any transfer (--stream-idle-timeout,
--min-stream-rate-mb), as before.

A pull that asks to wait (PullRequest.wait_seconds) while θ is the one it holds parks its
connection until a commit moves θ or the wait passes (`held_until_moved`), holding no buffer and
no reply room meanwhile: the room is taken after, for the θ it then carries.
"""

from __future__ import annotations

import array
import contextlib
import time
from collections.abc import Callable, Generator
from typing import Any

from gemps_proto.tensor_codec import WIRE_DTYPE_NAMES, expected_nbytes
from gemps_server.wire.data_plane_io import Channel, Hangup, Stalled
from gemps_server.wire.data_plane_loop import Parked, Task, Wait, Write
from gemps_server.wire.data_plane_uploads import Held, Lanes
from gemps_server.wire.reply_budget import ReplyBudget
from gemps_server.wire.streams import Pace

try:  # how many bytes wait unread in a socket (Linux, the BSDs, macOS)
    import fcntl
    import termios

    FIONREAD: int | None = termios.FIONREAD
except ImportError:  # elsewhere pipelining is only cut short by the pace
    FIONREAD = None

Steps = Generator[Wait, Any, Any]


def pull_room(dtype: int, num_parameters: int, sent: bool) -> int:
    """The reply budget a pull holds: θ's bytes in `dtype` when they are `sent` (not unchanged, not
    into shared memory), none for a dtype replies cannot carry (the service refuses it, in the
    protocol's order, as gRPC does)."""
    return expected_nbytes(dtype, [num_parameters]) if sent and dtype in WIRE_DTYPE_NAMES.values() else 0


def reply_room(budget: ReplyBudget, task: Task, nbytes: int) -> Steps:
    """Hold `nbytes` of `budget` for a reply, waiting in line (Parked, holding nothing) while they
    do not fit; the caller gives them back. Bytes granted to a task ended meanwhile go back."""

    def granted() -> bool:  # on the loop's thread (a give_back)
        def hand_over() -> None:
            if task.done:
                budget.give_back(nbytes)
            else:
                task.resume()

        task.loop.call_soon(hand_over)
        return True

    if budget.try_take(nbytes, granted):
        return
    try:
        yield Parked()
    finally:
        budget.withdraw(granted)  # ended while waiting (a no-op once granted)


def write_reply(
    channel: Channel, views: list[memoryview], nbytes: int, pace: Pace, lanes: Lanes, held: Held | None
) -> Steps:
    """Write `views` (a reply of `nbytes` payload bytes; from the pooled buffer `held`, if any).
    Stalled as any write once the pace is broken; Hangup("unread_replies") as the module says."""
    began = time.monotonic()
    paced = began + pace.allowance(nbytes)
    write = Write(views, pace.idle_timeout, min(paced, began + lanes.window(nbytes)))
    try:
        yield write
        return
    except Stalled:
        now = time.monotonic()
        if now >= paced or now - write.moved_at >= pace.idle_timeout:
            raise  # stalled, or slower than the pace itself
    if requests_waiting(channel):
        raise Hangup("unread_replies")
    if held is None or held.returned:
        yield Write(write.views, pace.idle_timeout, paced)
        return
    rest = sum(len(view) for view in write.views)
    if not lanes.replies.take_now(rest):
        raise Hangup("unread_replies")
    try:
        moved = [memoryview(bytes(view)) for view in write.views]  # out of the pooled buffer
        held.give_back()
        yield Write(moved, pace.idle_timeout, paced)
    finally:
        lanes.replies.give_back(rest)


def requests_waiting(channel: Channel) -> bool:
    """Whether the peer has sent bytes not read yet (a next request, while its reply is unread)."""
    if channel.buffered:
        return True
    if FIONREAD is None:
        return False
    count = array.array("i", [0])
    with contextlib.suppress(OSError):
        fcntl.ioctl(channel.sock.fileno(), FIONREAD, count, True)
    return count[0] > 0


def held_until_moved(
    task: Task, wait: float, when_moved: Callable[[Callable[[], None]], Callable[[], bool] | None]
) -> Steps:
    """Park `task` until θ moves (`when_moved(wake)`: ParameterService.when_moved for the pull's
    version and `wait`; None: answer now) or `wait` seconds pass, whichever first: both resume it
    on the loop's thread, the first alone."""
    resumed = False

    def resume_once() -> None:
        nonlocal resumed
        if not resumed:  # on the loop's thread, both ways: no lock
            resumed = True
            task.resume()

    forget = when_moved(lambda: task.loop.post(resume_once))
    if forget is None:
        return
    task.loop.call_later(wait, resume_once)
    try:
        yield Parked()
    finally:  # a connection closed meanwhile: its wait forgotten
        forget()
