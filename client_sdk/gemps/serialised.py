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

P = ParamSpec("P")
R = TypeVar("R")


class Serialised(Protocol):
    @property
    def _calls(self) -> threading.RLock: ...


S = TypeVar("S", bound=Serialised)


def serialised(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """`method`, run while holding its object's `_calls` lock."""

    @functools.wraps(method)
    def one_at_a_time(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._calls:
            return method(self, *args, **kwargs)

    return one_at_a_time
