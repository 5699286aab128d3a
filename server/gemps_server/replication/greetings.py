"""The replication listener's places for connections whose peer has not proved anything yet
(issue 61, item 11): what a flood without the credential can hold, and how a backup gets in anyway.

Each connection accepted holds a thread and at most a handshake's bytes for CONNECT_SECONDS, so
their number is bounded: MAX_GREETINGS in all, MAX_GREETINGS_PER_ADDRESS from one address. A flood
from a few addresses then cannot take every place (a backup on another address always finds one);
but one from the backup's own address took its address's places as fast as they were freed, and
a backup refused at the door kept its partition without redundancy for the whole flood.

So a newcomer from an address whose places are all held is not refused: it takes the place of
one of them, chosen at random (`place`), whose socket the listener shuts down. And a connection
leaves its place as soon as its hello carries the admission proof, a MAC only the job's replicas
can make (handshake.py: `vouched`), long before its handshake ends: a backup's connection is
displaced only if another connection from its address lands on its place in the moments before
its hello is read, so among a flood's newcomers it gets in after a few dials where it was refused
every time. Without the credential nothing leaves its place early: a flood only displaces itself.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: connections not yet vouched for, at most: in all, and from one address
MAX_GREETINGS = 64
MAX_GREETINGS_PER_ADDRESS = 2


@dataclass(eq=False)
class Greeting:
    """One accepted connection while it holds a place."""

    sock: socket.socket
    host: str
    placed: bool = True


class Greetings:
    """The places; thread-safe (the accepting thread places, each greeting's thread releases)."""

    def __init__(
        self,
        total: int = MAX_GREETINGS,
        per_address: int = MAX_GREETINGS_PER_ADDRESS,
        choose: Callable[[Sequence[Greeting]], Greeting] = random.choice,
    ) -> None:
        self.total, self.per_address = total, per_address
        self._choose = choose
        self._lock = threading.Lock()
        self._waiting: dict[str, list[Greeting]] = {}
        self.held = 0

    def place(self, sock: socket.socket, host: str) -> tuple[Greeting | None, Greeting | None]:
        """A place for `sock` from `host`: (its greeting, None when every place is held; the one
        it displaced, if any, whose socket the caller shuts down)."""
        with self._lock:
            waiting = self._waiting.setdefault(host, [])
            displaced = None
            if len(waiting) >= self.per_address:
                displaced = self._choose(waiting)
                self._release(displaced)
            elif self.held >= self.total:
                if not waiting:
                    del self._waiting[host]
                return None, None
            greeting = Greeting(sock, host)
            self._waiting.setdefault(host, []).append(greeting)
            self.held += 1
            return greeting, displaced

    def release(self, greeting: Greeting) -> None:
        """`greeting` leaves its place (vouched for, done, or displaced); again: nothing."""
        with self._lock:
            self._release(greeting)

    def from_address(self, host: str) -> int:
        with self._lock:
            return len(self._waiting.get(host, ()))

    def _release(self, greeting: Greeting) -> None:
        if not greeting.placed:
            return
        greeting.placed = False
        waiting = self._waiting[greeting.host]
        waiting.remove(greeting)
        if not waiting:
            del self._waiting[greeting.host]
        self.held -= 1
