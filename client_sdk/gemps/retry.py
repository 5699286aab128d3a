"""Exponential backoff with full jitter, for calls that failed with UNAVAILABLE or
DEADLINE_EXCEEDED (server down, restarting, paused or overloaded), and the loop that retries.

A replica that is not its partition's primary (`not_primary`) is a different case: a failover is
under way or the client reached a backup, and the next replica (or the same one, promoted a
moment later) will answer. Waiting longer and longer there only delays training, so such
refusals are retried after a short wait that does not grow, for up to FAILOVER_PATIENCE seconds
before they count as ordinary failures.

How long a call goes on retrying is the client's patience (`Client(patience=)`, GEMPS_PATIENCE,
`gemps worker --patience`; 300 s by default, a server's restart with room to spare): once the
server has not answered for that long, the call raises the last failure, naming the option. A
RetryPolicy's `max_attempts`, when set, also caps a call's attempts. Retries happen within the
call's deadline too (gemps.transport.call_deadline, the Client's `timeout`): a wait that would end
past it is not begun, and the call raises DeadlineExceededError with the last failure's message.

A call's first retry is logged at INFO (a blip a retry hides), and once the server has not answered
it for WARNING_AFTER_SECONDS a WARNING names the address and the patience, again every
STILL_WAITING_SECONDS: a plain script, which shows WARNINGs only, says what it waits for (a worker
started before its server, or given the wrong address, is otherwise silent for minutes)."""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
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
#: how long a call retries a server that does not answer, unless told (long enough for a restart)
DEFAULT_PATIENCE = 300.0
PATIENCE_VARIABLE = "GEMPS_PATIENCE"
#: where a user sets the patience, named when it runs out
PATIENCE_OPTIONS = f"Client(patience=...), {PATIENCE_VARIABLE} or `gemps worker --patience`"
#: a call the server has not answered this long is said at WARNING (a blip before is INFO)
WARNING_AFTER_SECONDS = 2.0
#: while retrying, a line this often says the client still waits (the others are DEBUG)
STILL_WAITING_SECONDS = 30.0
P = ParamSpec("P")


def resolve_patience(patience: float | None, environ: Mapping[str, str] | None = None) -> float:
    """`patience` when given, else GEMPS_PATIENCE, else DEFAULT_PATIENCE; ValueError naming it
    unless a number of seconds > 0."""
    if patience is None:
        raw = (os.environ if environ is None else environ).get(PATIENCE_VARIABLE)
        if raw is None:
            return DEFAULT_PATIENCE
        try:
            patience = float(raw)
        except ValueError:
            raise ValueError(f"{PATIENCE_VARIABLE}={raw!r} is not a number of seconds") from None
    if not (patience > 0 and math.isfinite(patience)):
        raise ValueError(f"patience must be a number of seconds > 0, not {patience}")
    return patience


@dataclass(frozen=True)
class RetryPolicy:
    """How a call's retries are spaced (exponential backoff with full jitter); `max_attempts`
    caps the tries of one call (None: no cap, the client's patience ends them)."""

    max_attempts: int | None = None
    initial_backoff: float = 0.1  # seconds
    max_backoff: float = 4.0
    multiplier: float = 2.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Sleep before each retry: uniform in [0, min(max, initial * multiplier**n)]."""
        rng = rng or random.Random()
        ceiling = self.initial_backoff
        retries = 0
        while self.max_attempts is None or retries < self.max_attempts - 1:
            yield rng.uniform(0.0, min(self.max_backoff, ceiling))
            ceiling = min(ceiling * self.multiplier, self.max_backoff)
            retries += 1


NO_RETRY = RetryPolicy(max_attempts=1)


class Retrier:
    """Runs attempts of a call to `target` until one succeeds, sleeping `policy`'s delays between
    them, for failures worth another attempt (errors.RETRIED), until the server has not answered
    for `patience` seconds and while the call's deadline leaves time for another (then
    DeadlineExceededError); counts the retries. Setting `stop` ends a wait with StoppedError."""

    def __init__(
        self,
        target: str,
        policy: RetryPolicy,
        stop: threading.Event | None = None,
        patience: float = DEFAULT_PATIENCE,
    ) -> None:
        self.target = target
        self.policy = policy
        self.stop = stop
        self.patience = patience
        #: attempts retried, over this retrier's life
        self.retries = 0

    def call(self, attempt: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`attempt(*args, **kwargs)` until it returns; other errors, and the last one, are raised
        (as DeadlineExceededError when the call's deadline is what ended the retries)."""
        delays: Iterator[float] | None = None  # the policy's waits, from the first failure on
        first_failure: float | None = None  # when the server last stopped answering this call
        told = _Told()  # what this call's retries have said
        failover_until: float | None = None  # while a failover is under way: quick retries
        while True:
            try:
                return attempt(*args, **kwargs)
            except errors.RETRIED as failure:
                error: errors.GempsError = failure
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if error.reason == Reason.NOT_PRIMARY:
                failover_until = failover_until or now + FAILOVER_PATIENCE
            if failover_until is not None and now < failover_until:
                delay: float | None = random.uniform(0.0, FAILOVER_RETRY_SECONDS)
            else:
                delays = self.policy.delays() if delays is None else delays
                delay = next(delays, None)
            deadline = current_deadline()
            if deadline is not None and deadline.left() <= (delay or 0.0):  # no time for another attempt
                raise deadline_exceeded(deadline, f"{self.target}: {error.message}") from None
            waited = now - first_failure
            if delay is not None and waited + delay > self.patience:
                raise type(error)(
                    f"{self.target} did not answer for {waited:.0f} s, the client's patience being "
                    f"{self.patience:g} s (set it with {PATIENCE_OPTIONS}): {error.message}",
                    error.code,
                    error.reason,
                )
            if delay is None:
                raise type(error)(
                    f"{self.target} unreachable after {self.policy.max_attempts} attempts: {error.message}",
                    error.code,
                    error.reason,
                )
            self.retries += 1
            told.retrying(self, error, delay, waited, now)
            if self.stop is not None and self.stop.wait(delay):
                raise errors.StoppedError(f"stopped while retrying {self.target}: {error.message}", error.code)
            if self.stop is None:
                time.sleep(delay)


@dataclass
class _Told:
    """What the retries of one call have logged: the first at INFO (a blip a retry hides), a
    WARNING naming the address once the wait carries the call's silence past
    WARNING_AFTER_SECONDS, and one line every STILL_WAITING_SECONDS after (the others are DEBUG),
    so that the user sees why nothing happens, and for how long it may."""

    said: float | None = None  # when a retry was last logged above DEBUG
    warned: bool = False

    def retrying(self, retrier: Retrier, error: errors.GempsError, delay: float, waited: float, now: float) -> None:
        due = self.said is None or now - self.said >= STILL_WAITING_SECONDS
        if (self.warned or waited + delay >= WARNING_AFTER_SECONDS) and (due or not self.warned):
            self.said, self.warned = now, True
            log.warning(
                "gemps: the server at %s has not answered for %.1f s (%s); retrying for up to %g s in all "
                "(the patience: %s)",
                retrier.target or "its address",
                waited,
                error.message,
                retrier.patience,
                PATIENCE_OPTIONS,
            )
        elif due:
            self.said = now
            log.info(
                "%s; retrying in %.2fs (giving up after %g s: the patience)", error.message, delay, retrier.patience
            )
        else:
            log.debug("%s; retrying in %.2fs", error.message, delay)
