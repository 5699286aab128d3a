"""Calls of one object serialised: one at a time, whichever thread makes them (`gemps.Client`).

A client's calls share what it holds between them: the request ids and numbers of its commits,
the base version each commit is taken from, and a data-plane connection that carries strictly
one request and its reply at a time. Two calls interleaved on it would read each other's replies
(a commit reported refused that was applied). So each call takes the object's reentrant lock
(`_calls`): a call made while another runs waits for it, and a call made from inside one (a
method using another) goes on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from gemps.transport import current_deadline, deadline_exceeded

P = ParamSpec("P")
R = TypeVar("R")


class Serialised(Protocol):
    @property
    def _calls(self) -> threading.RLock: ...


S = TypeVar("S", bound=Serialised)


def serialised(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """`method`, run while holding its object's `_calls` lock: waiting for it within the call's
    deadline when one is set (gemps.transport.call_deadline), else DeadlineExceededError."""

    @functools.wraps(method)
    def one_at_a_time(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        deadline = current_deadline()
        if not self._calls.acquire(timeout=-1 if deadline is None else max(0.0, deadline.left())):
            assert deadline is not None
            raise deadline_exceeded(deadline, "waiting for another call of this client (another thread)")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._calls.release()

    return one_at_a_time
