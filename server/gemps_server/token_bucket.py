"""The token bucket every rate limit of the server is: registrations (security.RateLimiter),
connections that never prove a ticket (wire/refusal_budget.py), TLS handshake work per address
(wire/tls_handshakes.py).

It holds `burst` tokens at most and earns `rate` a second. `allow` takes a cost only when the
bucket holds it (a call refused costs nothing); `charge` takes it whatever the bucket holds, so a
cost known only afterwards (a refused connection, a handshake's measured time) runs it into debt
that the next ones wait out; `delay` is how long until a cost would be allowed. A rate of 0 (or
less) is no limit. Thread-safe; the clock is injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """`burst` tokens at most (and at first), refilled at `rate` a second; `rate` <= 0: no limit."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = max(rate, 0.0)
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._counted = clock()
        self._lock = threading.Lock()

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._counted) * self.rate)
        self._counted = now
        return self._tokens

    def allow(self, cost: float = 1.0) -> bool:
        """Take `cost` if the bucket holds it: True; else False, and nothing taken."""
        if not self.rate:
            return True
        with self._lock:
            if self._refill() < cost:
                return False
            self._tokens -= cost
            return True

    def charge(self, cost: float = 1.0) -> None:
        """Take `cost` whatever the bucket holds (below 0: a debt later costs wait out)."""
        if self.rate:
            with self._lock:
                self._tokens = self._refill() - cost

    def delay(self, cost: float = 1.0) -> float:
        """Seconds until the bucket holds `cost` (0: it does now)."""
        if not self.rate:
            return 0.0
        with self._lock:
            return max(0.0, cost - self._refill()) / self.rate

    def full(self) -> bool:
        """Whether the bucket holds `burst`: as good as a new one."""
        if not self.rate:
            return True
        with self._lock:
            return self._refill() >= self.burst
