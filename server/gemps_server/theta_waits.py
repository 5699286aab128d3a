"""Pulls held until θ moves (PullRequest.wait_seconds): who waits, and waking them.

A worker that waits for its round (gemps.rounds) pulls θ until it moves; held here, its pull is
answered when the commit that closes the round moves θ, where a poll hears of it only at its next
pull. The service adds a wait only after it found θ unmoved for the caller, and checks again
after adding it (`ParameterService.when_moved`), so a move between the two is never missed; it
wakes every wait after each commit that moved θ, from the thread that counted the commit.

A rule of rounds may want some waiting workers' next commits before θ moves (a round a departure
left complete, or one above the workers' count): `moved(workers)` wakes their waits alone.

Each wait is one callback, woken at most once: `forget` and `moved` both take it out under the
lock, and only the one that took it acts on it. A held gRPC pull keeps one of the server's
--max-concurrent-rpcs for up to MAX_PULL_WAIT_SECONDS, so at most `limit` pulls are held at once
(the service's: half of them): past it a pull is answered at once, and commits always find room.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Collection


class ThetaWaits:
    """The pulls waiting for θ to move, each a callback to wake it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[str, Callable[[], None]]] = {}  # by key: the worker's id, its wake
        self._keys = itertools.count()
        self.holding = True  # False once the server stops: no pull is held

    def hold(
        self, unmoved: Callable[[], bool], wake: Callable[[], None], worker_id: str = ""
    ) -> Callable[[], bool] | None:
        """Wait while `unmoved()` (θ is still the caller's, `worker_id`'s): `wake` is called once
        it moves; the function that stops the wait (False: `wake` was already called). None: it
        moved already, or the server stops, or `limit` pulls are held: answer now. Added, then
        checked: a move between the two is not missed."""
        if not self.holding:
            return None
        key = self.add(wake, worker_id)
        if key is None:
            return None
        if unmoved() or not self.forget(key):
            return functools.partial(self.forget, key)
        return None

    def stop(self) -> None:
        """The server stops: every held pull answered now, and none held from here on."""
        self.holding = False
        self.moved()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, wake: Callable[[], None], worker_id: str = "") -> int | None:
        """Wait until the next `moved` (of `worker_id`): `wake` is called then, once; the key that
        forgets it (None: `limit` waits already, none added)."""
        with self._lock:
            if len(self._waiting) >= self.limit:
                return None
            key = next(self._keys)
            self._waiting[key] = (worker_id, wake)
            return key

    def forget(self, key: int) -> bool:
        """Stop waiting: True when it was still waiting, False when `moved` took it (its `wake`
        called, or being called, on another thread)."""
        with self._lock:
            return self._waiting.pop(key, None) is not None

    def moved(self, workers: Collection[str] | None = None) -> None:
        """θ moved (or the server stops answering): every wait woken, on this thread; with
        `workers`, the waits of those workers alone (a round wants their next commits)."""
        if not self._waiting:  # the common case, no lock: a wait added after this read sees θ moved
            return
        with self._lock:
            if workers is None:
                woken, self._waiting = self._waiting, {}
            else:
                woken = {key: wait for key, wait in self._waiting.items() if wait[0] in workers}
                for key in woken:
                    del self._waiting[key]
        for _, wake in woken.values():
            wake()
