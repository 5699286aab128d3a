"""The bytes of θ-carrying replies the server holds for clients that have not read them yet.

gRPC takes a reply whole and keeps it (about two copies: the serialized message and its own)
until the client's HTTP/2 flow control lets it out; a client that never reads holds it for as long
as its connection lives, and one connection can have many calls open. So every reply carrying
θ (Register, Pull, Commit, PullStream) first takes its size from this budget, before it is built,
and gives it back once gRPC has sent it (or the call ended): past the budget, calls wait here
holding nothing. Waiters are served in arrival order, and a reply larger than the whole budget
still goes when nothing else is held.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ReplyBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a reply budget needs at least one byte, not {limit_bytes}")
        self.limit = limit_bytes
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, nbytes: int) -> bool:
        return self.held == 0 or self.held + nbytes <= self.limit

    async def take(self, nbytes: int) -> None:
        """Hold `nbytes`, waiting (in order) while they do not fit."""
        if not self._waiting and self._fits(nbytes):  # the usual case: no suspension
            self.held += nbytes
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiting.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back(nbytes)  # granted just as the call was cancelled
            else:
                self._waiting.remove(entry)
                self._wake()  # a smaller waiter behind this one may fit now
            raise

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            nbytes, waiter = self._waiting.popleft()
            if waiter.cancelled():
                continue
            self.held += nbytes
            waiter.set_result(None)
