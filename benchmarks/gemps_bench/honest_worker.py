"""What the attack scripts measure (docs/RELIABILITY.md, issue 42): an honest worker's commits
while attackers run, and the attackers' threads themselves.

    latencies = commit_latencies(client, size, window)   # one per commit done in `window` s
    rate = commit_rate(client, size, window)             # commits per second
    in_threads(work, count, stop, total)                 # `count` attackers until `stop`
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

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


def in_threads(work: Callable[[list[int]], None], count: int, stop: Event, total: Any) -> None:
    """Run `work(counter)` in `count` daemon threads, each with a counter of its own ([0]), until
    `stop`; then `total.value` (a multiprocessing Value("i")) is what they counted together."""
    counters = [[0] for _ in range(count)]
    threads = [threading.Thread(target=work, args=(counter,), daemon=True) for counter in counters]
    for thread in threads:
        thread.start()
    stop.wait()
    total.value = sum(counter[0] for counter in counters)
