"""Calls of one object serialised: one at a time, whichever thread makes them, each within one
deadline (`gemps.Client`).

A client's calls share what it holds between them: the request ids and numbers of its commits,
the base version each commit is taken from, and a data-plane connection that carries strictly
one request and its reply at a time. Two calls interleaved on it would read each other's replies
(a commit reported refused that was applied). So each call takes the object's reentrant lock
(`_calls`): a call made while another runs waits for it, and a call made from inside one (a
method using another) goes on. The call's deadline (the object's `timeout`, from when it is made)
starts before that wait: every attempt, retry and fallback inside, and the wait, share it
(gemps.transport.call_deadline; issue 42, item 5).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from gemps.transport import call_deadline, deadline_exceeded

P = ParamSpec("P")
R = TypeVar("R")


class Serialised(Protocol):
    @property
    def _calls(self) -> threading.RLock: ...

    @property
    def timeout(self) -> float: ...


S = TypeVar("S", bound=Serialised)


def serialised(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """`method` within one deadline, the object's `timeout` from when it is called (an outer
    deadline, gemps.aio's, when sooner), run while holding its object's `_calls` lock: waiting
    for it within that deadline, else DeadlineExceededError."""

    @functools.wraps(method)
    def one_at_a_time(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with call_deadline(self.timeout) as deadline:
            if not self._calls.acquire(timeout=max(0.0, deadline.left())):
                raise deadline_exceeded(deadline, "waiting for another call of this client (another thread)")
            try:
                return method(self, *args, **kwargs)
            finally:
                self._calls.release()

    return one_at_a_time
