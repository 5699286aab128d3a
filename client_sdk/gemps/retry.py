"""Exponential backoff with full jitter, for calls that failed with UNAVAILABLE or
DEADLINE_EXCEEDED (server down, restarting, paused or overloaded)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


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
