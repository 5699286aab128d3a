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
That step has gathered its own gradients by then (and counted its buffers' change sent): they are
sent all the same, after the failure, so that none is lost with it (issue 77), and the error, an
InFlightCommitError, names both steps and what became of each.

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

from gemps.errors import GempsError

T = TypeVar("T")


class InFlightCommitError(GempsError):
    """An overlapped commit's failure, raised by the call after it. `step` is the `step()` whose
    commit failed (counted from 1 on each RemoteModel) and `base_version` the version its
    gradients were computed at; `sent_step` the step that raises it, whose gradients (computed at
    `sent_base_version`) were sent after it all the same: in flight, the next step(), flush() or
    close() has their outcome. Both None when flush(), close(), pull() or commit_update() raises
    it. Made by `of()`, it is also an instance of the failure's class, with its attributes
    (`except gemps.InvalidArgumentError` catches it as before; a PartiallyAppliedError's
    `applied` stay readable); `__cause__` is the failure."""

    def __init__(self, failure: GempsError, step: int, base_version: int, sent: tuple[int, int] | None) -> None:
        vars(self).update(vars(failure))  # the failure's own attributes (PartiallyAppliedError's `central`, ...)
        if sent is None:
            then = "no later step's gradients were sent"
        else:
            then = f"step {sent[0]}'s gradients (computed at version {sent[1]}) were sent after it all the same"
        GempsError.__init__(  # not super(): the failure's class comes next, with its own arguments
            self,
            f"step {step}'s commit (its gradients computed at version {base_version}) failed: {failure.message}; "
            f"{then}",
            failure.code,
            failure.reason,
        )
        self.step, self.base_version = step, base_version
        self.sent_step: int | None = None if sent is None else sent[0]
        self.sent_base_version: int | None = None if sent is None else sent[1]

    @classmethod
    def of(
        cls, failure: GempsError, step: int, base_version: int, sent: tuple[int, int] | None = None
    ) -> InFlightCommitError:
        """`failure` of the commit of `step` (at `base_version`); `sent`: the step, and its base
        version, whose gradients were sent after it."""
        kind = type(failure)
        if kind not in _IN_FLIGHT_CLASSES:
            _IN_FLIGHT_CLASSES[kind] = type(f"InFlight{kind.__name__}", (cls, kind), {})
        return _IN_FLIGHT_CLASSES[kind](failure, step, base_version, sent)


_IN_FLIGHT_CLASSES: dict[type[GempsError], type[InFlightCommitError]] = {}


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
