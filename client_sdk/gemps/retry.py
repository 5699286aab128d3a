"""Exponential backoff with full jitter, for calls that failed with UNAVAILABLE."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8
    initial_backoff: float = 0.1  # seconds
    max_backoff: float = 5.0
    multiplier: float = 2.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Sleep before each retry: uniform in [0, min(max, initial * multiplier**n)]."""
        rng = rng or random.Random()
        ceiling = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            yield rng.uniform(0.0, min(self.max_backoff, ceiling))
            ceiling *= self.multiplier


NO_RETRY = RetryPolicy(max_attempts=1)
