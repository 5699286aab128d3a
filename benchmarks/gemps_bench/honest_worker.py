"""What the attack scripts measure (docs/RELIABILITY.md, issue 42): an honest worker's commits
while attackers run.

    latencies = commit_latencies(client, size, window)   # one per commit done in `window` s
    rate = commit_rate(client, size, window)             # commits per second
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

import gemps


def commit_latencies(
    client: gemps.Client, size: int, window: float, on_failure: Callable[[gemps.GempsError], None] | None = None
) -> list[float]:
    """The seconds each commit of `size` small values took, committing for `window` seconds; a
    commit that fails is handed to `on_failure` and not counted (without it, it is raised)."""
    payload = np.full(size, 1e-6, np.float32)
    latencies: list[float] = []
    end = time.monotonic() + window
    while time.monotonic() < end:
        started = time.perf_counter()
        try:
            client.commit(payload)
        except gemps.GempsError as error:
            if on_failure is None:
                raise
            on_failure(error)
            continue
        latencies.append(time.perf_counter() - started)
    return latencies


def commit_rate(client: gemps.Client, size: int, window: float) -> float:
    """Commits per second, committing for `window` seconds."""
    started = time.monotonic()
    done = len(commit_latencies(client, size, window))
    return done / (time.monotonic() - started)
