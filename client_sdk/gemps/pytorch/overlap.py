"""One commit in flight while the next step computes (`RemoteModel(..., overlap=True)`, issue 59 item 3).

A worker that waits for each reply before its next forward pays compute + round trip per commit;
across a slow link the round trip can be most of it. With overlap, `step()` hands the commit to a
thread of its own and returns; the next `step()` first gathers the new gradients (computed at
the θ loaded one step earlier, so GEM sees one more step of staleness: the server's staleness
counts it), then waits for the commit in flight, loads the θ its reply carries, and sends the new
commit. At most one commit is in flight, so memory and the server's view are as before; the
commit itself is the same `Client.commit` call with its request id and retries, so exactly-once,
failover to a new primary and the errors it raises are unchanged: an error of commit t is raised
by the step after it (or by `flush()`/`close()`), once its partial reply, if any, was loaded.

The gradients go to one of two staging vectors, alternately: the one a commit in flight is sent
from is never written. On a GPU the staging vectors are pinned and the gradients' copies into
them asynchronous; the sending thread waits for their completion events, so the training thread
does not synchronise the devices every step.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class InFlight(Generic[T]):
    """At most one call running on a thread of its own; `take()` waits for it."""

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemps-commit")
        self._pending: concurrent.futures.Future[T] | None = None

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def submit(self, call: Callable[[], T]) -> None:
        if self._pending is not None:
            raise RuntimeError("a commit is already in flight: take() it first")
        self._pending = self._executor.submit(call)

    def take(self) -> T | None:
        """What the call in flight returned (its exception raised); None when none is in flight."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class Staging:
    """Two float32 vectors of `size`, handed out in turn (pinned for GPU models)."""

    def __init__(self, first: torch.Tensor) -> None:
        self._vectors = [first, torch.zeros_like(first).pin_memory() if first.is_pinned() else torch.zeros_like(first)]
        self._turn = 0

    def next(self) -> torch.Tensor:
        vector = self._vectors[self._turn]
        self._turn ^= 1
        return vector


def copies_done(gpus: list[torch.device]) -> Callable[[], None]:
    """A wait for the copies queued on `gpus`' current streams so far (none: returns at once), for
    the thread that sends what they copy."""
    events = []
    for gpu in gpus:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(gpu))
        events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait
