"""The bytes of θ-carrying replies the server holds for clients that have not read them yet.

gRPC takes a reply whole and keeps it (about two copies: the serialized message and its own)
until the client's HTTP/2 flow control lets it out; a client that never reads holds it for as long
as its connection lives, and one connection can have many calls open. So every reply carrying
θ (Register, Pull, Commit, PullStream) first takes its size from this budget, before it is built,
and gives it back once gRPC has sent it (or the call ended): past the budget, calls wait here
holding nothing. Waiters are served in arrival order, and a reply larger than the whole budget
still goes when nothing else is held.

The data plane has a budget of its own of the same size (its loop's thread, not gRPC's): what
its replies pin while their readers lag (a pull's shared encoding of a version, a commit's θ moved
out of its pooled buffer), data_plane_replies.py. `try_take` and `take_now` are its calls; `take`
is asyncio's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

# Called when a waiter's bytes are held for it; False: the waiter is gone (then nothing is held).
Grant = Callable[[], bool]


class ReplyBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a reply budget needs at least one byte, not {limit_bytes}")
        self.limit = limit_bytes
        self.held = 0
        self._waiting: deque[tuple[int, Grant]] = deque()

    def _fits(self, nbytes: int) -> bool:
        return self.held == 0 or self.held + nbytes <= self.limit

    def take_now(self, nbytes: int) -> bool:
        """Hold `nbytes` if they fit now, and no one waits (then True); never waits."""
        if self._waiting or not self._fits(nbytes):
            return False
        self.held += nbytes
        return True

    def try_take(self, nbytes: int, granted: Grant) -> bool:
        """Hold `nbytes` now (True); else wait in line, and `granted()` is called once they are
        held (from a give_back: on its thread)."""
        if self.take_now(nbytes):
            return True
        self._waiting.append((nbytes, granted))
        return False

    def withdraw(self, granted: Grant) -> bool:
        """Leave the line; False when `granted` was not in it (its bytes were granted)."""
        for entry in self._waiting:
            if entry[1] is granted:
                self._waiting.remove(entry)
                self._wake()  # a smaller waiter behind this one may fit now
                return True
        return False

    async def take(self, nbytes: int) -> None:
        """Hold `nbytes`, waiting (in order) while they do not fit."""
        if self.take_now(nbytes):  # the usual case: no suspension
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def granted() -> bool:
            if waiter.cancelled():
                return False
            waiter.set_result(None)
            return True

        self._waiting.append((nbytes, granted))
        try:
            await waiter
        except asyncio.CancelledError:
            if not self.withdraw(granted) and waiter.done() and not waiter.cancelled():
                self.give_back(nbytes)  # granted just as the call was cancelled
            raise

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            nbytes, granted = self._waiting.popleft()
            self.held += nbytes
            if not granted():
                self.held -= nbytes
