"""Workers running at once, a thread each, as separate processes would (the adamw rule's rounds
close only on several workers' gradients)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np

import gemps


def run_together(jobs: Sequence[Callable[[], object]], timeout: float = 120) -> None:
    """Run each job on a thread of its own, all at once; every one must end within `timeout`."""
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads)


def commit_together(clients: Mapping[str, gemps.Client], gradient: np.ndarray, count: int) -> dict[str, list[int]]:
    """Each client commits `gradient` `count` times, all clients at once: each commit's
    `round_pending` (K - 1 for a round's first commit), by the clients' keys."""
    pending: dict[str, list[int]] = {key: [] for key in clients}

    def commit(key: str) -> None:
        for _ in range(count):
            pending[key].append(clients[key].commit(gradient).round_pending)

    run_together([partial(commit, key) for key in clients])
    return pending
