"""Exponential backoff with full jitter, for calls that failed with UNAVAILABLE or
DEADLINE_EXCEEDED (server down, restarting, paused or overloaded), and the loop that retries."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from gemps import errors

log = logging.getLogger("gemps.client")

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `max_attempts` tries per call. The defaults ride out about 20 s to 40 s of outage
    (a server restarted by its supervisor) before giving up."""

    max_attempts: int = 15
    initial_backoff: float = 0.1  # seconds
    max_backoff: float = 4.0
    multiplier: float = 2.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Sleep before each retry: uniform in [0, min(max, initial * multiplier**n)]."""
        rng = rng or random.Random()
        ceiling = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            yield rng.uniform(0.0, min(self.max_backoff, ceiling))
            ceiling *= self.multiplier


NO_RETRY = RetryPolicy(max_attempts=1)


class Retrier:
    """Runs attempts of a call to `target` until one succeeds, sleeping `policy`'s delays between
    them, for failures worth another attempt (errors.RETRIED); counts the retries. Setting `stop`
    ends a wait with StoppedError."""

    def __init__(self, target: str, policy: RetryPolicy, stop: threading.Event | None = None) -> None:
        self.target = target
        self.policy = policy
        self.stop = stop
        #: attempts retried, over this retrier's life
        self.retries = 0

    def call(self, attempt: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`attempt(*args, **kwargs)` until it returns; other errors, and the last one, are raised."""
        return self.call_on(_nothing, lambda _: attempt(*args, **kwargs), _nothing)

    def call_on(self, pick: Callable[[], S], attempt: Callable[[S], T], failed: Callable[[], None]) -> T:
        """`attempt(pick())` until it returns, as `call`: `pick` chooses what each attempt calls (a
        session following its server when it moved) and `failed` hears of each failure worth
        another attempt. The caller's file is entered for `pick` and left before the attempt."""
        delays = self.policy.delays()
        retrying = False
        while True:
            try:
                return attempt(pick())
            except errors.RETRIED as failure:
                error: errors.GempsError = failure
                failed()
            delay = next(delays, None)
            if delay is None:
                raise type(error)(
                    f"{self.target} unreachable after {self.policy.max_attempts} attempts: {error.message}",
                    error.code,
                    error.reason,
                )
            self.retries += 1
            # The first retry of a call is worth a line: the user sees why nothing happens.
            log.log(logging.DEBUG if retrying else logging.INFO, "%s; retrying in %.2fs", error.message, delay)
            retrying = True
            if self.stop is not None and self.stop.wait(delay):
                raise errors.StoppedError(f"stopped while retrying {self.target}: {error.message}", error.code)
            if self.stop is None:
                time.sleep(delay)


def _nothing() -> None:
    pass
