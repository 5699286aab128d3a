"""How fast connections that never prove a ticket may cost the data plane's thread (DESIGN §3b:
resources before trust are budgeted; issue 42, items 2 to 4).

Refusing a connection is cheap, not free: its accept, a read, the refusal, its close took the
loop about 60 µs, and a local process that connected, passed descriptors and was refused over
and over (6,700 times a second) took 0.4 of a core from the thread that serves every worker's
commits: theirs fell to 0.38-0.45x. So each listener has a budget of connections that end
without proving a ticket (refused, evicted, timed out), --data-plane-refusals-per-second with
bursts of BURST_SECONDS' worth: spent, the listener is not accepted from until it refills. The
connections that arrive meanwhile wait in the kernel's queue, which slows whoever floods it
(their connects wait too); workers already connected are not touched, and a newcomer is accepted
in its turn when accepting resumes (the SDK uses gRPC meanwhile).
"""

from __future__ import annotations

import time

BURST_SECONDS = 2.0


class RefusalBudget:
    """A token bucket: `charge()` for each connection that ended without proving a ticket;
    `delay()` is 0 while one may still be accepted, else the seconds until one may (0 per second:
    no limit)."""

    def __init__(self, per_second: float) -> None:
        self._rate = per_second
        self._burst = per_second * BURST_SECONDS
        self._tokens = self._burst
        self._counted = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._counted) * self._rate)
        self._counted = now

    def charge(self) -> None:
        if self._rate:
            self._refill()
            self._tokens -= 1.0

    def delay(self) -> float:
        if not self._rate:
            return 0.0
        self._refill()
        return 0.0 if self._tokens >= 1.0 else (1.0 - self._tokens) / self._rate
