"""The data plane's event loop: one thread moves every connection's bytes with non-blocking sockets.

A connection's protocol (data_plane_calls.py) is a generator that yields what it waits for and
is resumed with it, so it reads top to bottom as blocking code would:

    yield ReadInto(view, ...)         bytes into a buffer of the caller's
    yield Write([header, theta])      bytes out, from their own memory
    sock = yield Handshake(deadline)  the TLS handshake, done on another thread (tls_handshakes.py)
    value = yield Parked()            a pooled buffer: resumed by `resume`
    value = yield Call(start)         the service's result: the loop starts it, and hands it over

An I/O wait that sees no byte move for its `stall` seconds, or passes its `deadline`, is resumed
with Stalled; a peer that goes away, with PeerClosed. Why one thread and not one per connection:
a thread per connection hands the GIL between threads on every frame, and with 8 clients at 100K
parameters that cost more server CPU per commit than the commit itself (docs/PERFORMANCE.md).
Work that takes long (GEM on a large θ) runs on the applier's thread meanwhile, and hands its
result back here with `post`.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import math
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from gemps_server.logs import event
from gemps_server.wire.data_plane_io import Channel, Hangup, PeerClosed, Stalled

log = logging.getLogger("gemps.server")

# How often, at most, waits are checked against their stall timeouts and deadlines (and so how
# late past one a connection may be closed): the loop never sleeps longer than this.
TICK_SECONDS = 0.05


if hasattr(selectors, "EpollSelector"):

    class _ArrivalOrder(selectors.EpollSelector):
        """epoll, edge-triggered: a socket joins the ready list when bytes arrive on it, at its
        end, so a batch comes out in the order requests arrived (FIFO across connections). Level-
        triggered epoll puts a socket it reported back in the list at once, at the place it had,
        and a request arriving later there overtakes earlier ones elsewhere (seen: 8 requests
        applied 2..9, 1). Every wait reads or writes until the socket would block before it waits
        (Wait.attempt), which is what edge triggering needs."""

        _EVENT_READ = select.EPOLLIN | select.EPOLLET
        _EVENT_WRITE = select.EPOLLOUT | select.EPOLLET

        def rearm(self, fd: int, events: int) -> None:
            """Report `fd`, registered for `events`, again if it is ready now, behind the sockets
            already in the list (given both: the selector's own lookup costs more than the call)."""
            flags = self._EVENT_READ if events & selectors.EVENT_READ else 0
            flags |= self._EVENT_WRITE if events & selectors.EVENT_WRITE else 0
            self._selector.modify(fd, flags)  # type: ignore[attr-defined]  # the epoll object EpollSelector wraps

    def _selector() -> selectors.BaseSelector:
        return _ArrivalOrder()

else:  # elsewhere: level-triggered, requests about in arrival order

    def _selector() -> selectors.BaseSelector:
        return selectors.DefaultSelector()


class Wait:
    """What a connection waits for. `attempt` tries to finish it now, without blocking."""

    events = 0  # readiness to wait for when `attempt` could not finish (0: someone calls resume)
    idle = False  # waiting for a new request: a stopping server closes such a connection at once

    def attempt(self, channel: Channel, now: float) -> bool:
        raise NotImplementedError

    def expires(self) -> float:
        """When it fails with Stalled (math.inf: never)."""
        return math.inf


class _Timed(Wait):
    def __init__(self, stall: float, deadline: float | None) -> None:
        self.stall = stall
        self.deadline = math.inf if deadline is None else deadline
        self.moved_at = time.monotonic()

    def expires(self) -> float:
        return min(self.moved_at + self.stall, self.deadline)


class ReadInto(_Timed):
    """Fill `view`; Stalled when no byte comes for `stall` seconds, or past `deadline`. An `idle`
    wait (for a request to start) is idle until its first byte: from then on no byte may take
    longer than `then_stall` (one wait for a frame's whole start, not one for its first byte and
    another for the rest)."""

    def __init__(
        self,
        view: memoryview,
        stall: float,
        deadline: float | None = None,
        *,
        idle: bool = False,
        then_stall: float | None = None,
    ) -> None:
        super().__init__(stall, deadline)
        self.view = view
        self.filled = 0
        self.idle = idle
        self.then_stall = stall if then_stall is None else then_stall

    def attempt(self, channel: Channel, now: float) -> bool:
        view, size = self.view, len(self.view)
        while self.filled < size:
            count = channel.read_some(view[self.filled :] if self.filled else view)
            if not count:
                self.events = channel.wants
                return False
            self.filled += count
            self.moved_at = now
            if self.idle:  # a request started: no longer idle, and a stall is the stream's
                self.idle, self.stall = False, self.then_stall
        return True


class Write(_Timed):
    """Send the views in order; Stalled as ReadInto."""

    def __init__(self, views: list[memoryview], stall: float, deadline: float | None = None) -> None:
        super().__init__(stall, deadline)
        self.views = views

    def attempt(self, channel: Channel, now: float) -> bool:
        while self.views:
            if not channel.write_some(self.views):
                self.events = channel.wants
                return False
            self.moved_at = now
        return True


class Parked(Wait):
    """Resumed by whoever holds the task (`Task.resume`): a buffer pool, the applier. `pinned`:
    something outside the task writes into its memory until then (the applier, a reply into its
    pooled buffer), so the task must not be ended before it is resumed."""

    def __init__(self, *, pinned: bool = False) -> None:
        self.pinned = pinned

    def attempt(self, channel: Channel, now: float) -> bool:
        return False


class Handshake(Parked):
    """The TLS handshake, done off this thread (its crypto would stall every connection here):
    resumed with the handshaken socket, or PeerClosed; Stalled past `deadline`."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def expires(self) -> float:
        return self.deadline


class Call(Parked):
    """`result = yield Call(start)`: the loop calls `start(deliver)`, and the task goes on with
    what `deliver(value, error)` hands over, at once or from the applier's thread. Pinned: the
    applier may be writing the reply into this task's buffer meanwhile."""

    def __init__(self, start: Callable[[Callable[[Any, BaseException | None], None]], None]) -> None:
        super().__init__(pinned=True)
        self.start = start


Body = Generator[Wait, Any, None]


def _nothing() -> Body:
    return
    yield  # a generator that ends at once


class Task:
    """One connection: its channel and the generator that serves it."""

    def __init__(self, loop: Loop, channel: Channel) -> None:
        self.loop = loop
        self.channel = channel
        self.body: Body = _nothing()
        self.waiting: Wait | None = None
        self.registered = 0  # the selector events it is registered for
        self.done = False

    def step(self, value: Any = None, error: BaseException | None = None) -> None:
        """Run the body until it waits for something that is not there yet, or ends."""
        now = time.monotonic()
        while True:
            try:
                wait = self.body.throw(error) if error is not None else self.body.send(value)
            except StopIteration:
                self.loop.finish(self)
                return
            except Exception as failure:  # a bug must not take the loop down with it
                failed = f"{type(failure).__name__}: {failure}"
                event(log, "data-plane connection failed", level=logging.ERROR, error=failed)
                self.loop.finish(self)
                return
            value, error = None, None
            if isinstance(wait, Call) and (delivered := self._start(wait)) is not None:
                value, error = delivered
                continue
            if wait.idle and not self.channel.buffered:
                # A new request is read when the loop reports it, in its turn: one that arrived
                # while this task finished the last must not overtake those already waiting.
                self.waiting = wait
                wait.events = selectors.EVENT_READ
                self.loop.watch(self, wait.events, rearm=True)
                return
            try:
                if wait.attempt(self.channel, now):
                    value = None
                    continue
            except (PeerClosed, Hangup) as closed:  # Hangup: the channel refused what came (descriptors)
                error = closed
                continue
            self.waiting = wait
            self.loop.watch(self, wait.events)
            return

    def ready(self, now: float) -> None:
        """The socket is ready for what the task waits for: try again."""
        wait = self.waiting
        if wait is None or not wait.events:
            return
        try:
            finished = wait.attempt(self.channel, now)
        except (PeerClosed, Hangup) as closed:
            self._continue(None, closed)
            return
        if finished:
            self._continue(None, None)
        else:
            self.loop.watch(self, wait.events)

    def _start(self, call: Call) -> tuple[Any, BaseException | None] | None:
        """Start `call` (the service's asynchronous call): what it delivered at once when it ran
        on this thread (a small model, the applier idle), else None and the applier's thread
        hands the result over through the loop (`post`, then `resume`)."""
        delivered: list[tuple[Any, BaseException | None]] = []

        def deliver(value: Any, error: BaseException | None) -> None:
            if self.loop.on_loop_thread():
                delivered.append((value, error))
            else:
                self.loop.post(lambda: self.resume(value, error))

        try:
            call.start(deliver)
        except Exception as error:  # refused before it was queued (an unknown worker): thrown in the task
            return None, error
        return delivered[0] if delivered else None

    def resume(self, value: Any = None, error: BaseException | None = None) -> None:
        """End a Parked wait with `value` (or `error`), on the loop's thread."""
        self._continue(value, error)

    def expire(self) -> None:
        self._continue(None, Stalled())

    def _continue(self, value: Any, error: BaseException | None) -> None:
        if self.done:  # ended meanwhile (a server stopping): nothing to continue
            return
        self.waiting = None
        self.step(value, error)  # ends in watch(): the next wait's events, or none


class Loop:
    """The selector, the tasks, the timers and the hand-over from other threads (`post`)."""

    def __init__(self) -> None:
        self.selector = _selector()
        self.tasks: set[Task] = set()
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self.selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._listeners: dict[socket.socket, Callable[[socket.socket], None]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  # a heap: (when, order, callback)
        self._order = itertools.count()
        self.thread_id = 0
        self._next_check = 0.0

    # -- from any thread ------------------------------------------------------------------------

    def post(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread, soon."""
        self._posted.append(callback)
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending anyway
            self._wake_writer.send(b"\0")

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    # -- on the loop's thread -------------------------------------------------------------------

    def listen(self, listener: socket.socket, accept: Callable[[socket.socket], None]) -> None:
        listener.setblocking(False)
        self._listeners[listener] = accept
        self.selector.register(listener, selectors.EVENT_READ, None)

    def stop_listening(self) -> None:
        """Close every listener: no connection is accepted any more."""
        for listener in list(self._listeners):
            self.selector.unregister(listener)
            listener.close()
        self._listeners.clear()

    def spawn(self, channel: Channel, body: Callable[[Task], Body]) -> Task:
        """Serve `channel` with the generator `body(task)` makes, starting now."""
        task = Task(self, channel)
        task.body = body(task)
        self.tasks.add(task)
        task.step()
        return task

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread in `delay` seconds (a tick late at most)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._order), callback))

    def call_soon(self, callback: Callable[[], None]) -> None:
        """post() from the loop's own thread: after what it is doing now, without a wake-up."""
        self._posted.append(callback)

    def watch(self, task: Task, events: int, rearm: bool = False) -> None:
        """Register `task`'s socket for `events` (0: for none); `rearm`: report it in the next
        select if it is ready already, even when its registration does not change."""
        if task.done:
            return
        if events == task.registered:
            if rearm and events and hasattr(self.selector, "rearm"):
                self.selector.rearm(task.channel.sock.fileno(), events)
            return
        sock = task.channel.sock
        if not task.registered:
            self.selector.register(sock, events, task)
        elif not events:
            self.selector.unregister(sock)
        else:
            self.selector.modify(sock, events, task)
        task.registered = events

    def finish(self, task: Task) -> None:
        """The task ended (or is ended): its socket closed, its body closed (a `finally` in it gives
        back what it holds)."""
        if task.done:
            return
        self.watch(task, 0)
        task.done = True
        self.tasks.discard(task)
        task.body.close()
        task.channel.close()

    def run_once(self) -> None:
        """Wait for readiness (at most a tick), then serve what is ready, posted, or expired."""
        for key, _events in self.selector.select(TICK_SECONDS):
            if key.data is not None:
                key.data.ready(time.monotonic())
            elif key.fileobj is self._wake_reader:
                with contextlib.suppress(BlockingIOError):
                    while self._wake_reader.recv(4096):
                        pass
            else:
                listener = key.fileobj
                assert isinstance(listener, socket.socket)
                self._listeners[listener](listener)
        while self._posted:
            self._posted.popleft()()
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            heapq.heappop(self._timers)[2]()
        if now >= self._next_check:
            self._next_check = now + TICK_SECONDS
            for task in [t for t in self.tasks if t.waiting is not None and t.waiting.expires() <= now]:
                if not task.done and task.waiting is not None:
                    task.expire()

    def close(self) -> None:
        for task in list(self.tasks):
            self.finish(task)
        self.stop_listening()
        self.selector.close()
        self._wake_reader.close()
        self._wake_writer.close()
