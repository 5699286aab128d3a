"""Exponential backoff with full jitter, for calls that failed with UNAVAILABLE or
DEADLINE_EXCEEDED (server down, restarting, paused or overloaded), and the loop that retries.

A replica that is not its partition's primary (`not_primary`) is a different case: a failover is
under way or the client reached a backup, and the next replica (or the same one, promoted a
moment later) will answer. Waiting longer and longer there only delays training, so such
refusals are retried after a short wait that does not grow, for up to FAILOVER_PATIENCE seconds
before they count as ordinary failures.

Retries happen within the call's deadline (gemps.transport.call_deadline, the Client's
`timeout`): a wait that would end past it is not begun, and the call raises DeadlineExceededError
with the last failure's message."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from gemps import errors
from gemps.transport import current_deadline, deadline_exceeded
from gemps_proto.reasons import Reason

log = logging.getLogger("gemps.client")

T = TypeVar("T")

#: how long refusals by replicas that are not primary are retried quickly (a failover's length)
FAILOVER_PATIENCE = 60.0
#: the most a retry after such a refusal waits
FAILOVER_RETRY_SECONDS = 0.25
P = ParamSpec("P")


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
    them, for failures worth another attempt (errors.RETRIED), while the call's deadline leaves
    time for another (then DeadlineExceededError); counts the retries. Setting `stop` ends a wait
    with StoppedError."""

    def __init__(self, target: str, policy: RetryPolicy, stop: threading.Event | None = None) -> None:
        self.target = target
        self.policy = policy
        self.stop = stop
        #: attempts retried, over this retrier's life
        self.retries = 0

    def call(self, attempt: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`attempt(*args, **kwargs)` until it returns; other errors, and the last one, are raised
        (as DeadlineExceededError when the call's deadline is what ended the retries)."""
        delays = self.policy.delays()
        retrying = False
        failover_until: float | None = None  # while a failover is under way: quick retries
        while True:
            try:
                return attempt(*args, **kwargs)
            except errors.RETRIED as failure:
                error: errors.GempsError = failure
            if error.reason == Reason.NOT_PRIMARY:
                failover_until = failover_until or time.monotonic() + FAILOVER_PATIENCE
            if failover_until is not None and time.monotonic() < failover_until:
                delay: float | None = random.uniform(0.0, FAILOVER_RETRY_SECONDS)
            else:
                delay = next(delays, None)
            deadline = current_deadline()
            if deadline is not None and deadline.left() <= (delay or 0.0):  # no time for another attempt
                raise deadline_exceeded(deadline, f"{self.target}: {error.message}") from None
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
