"""The server's parts behind one lifecycle: a `Part` starts, and stops within a grace; a `Stack`
starts parts in the order declared and stops them in reverse.

The order is declared once (app.py), so start and stop cannot drift apart: a start that fails
unwinds exactly the parts already started, as a stop with no grace (a process that cannot start
holds no port, thread or checkpoint directory, and an in-process server that could not start
serves nothing), and a stop lets go of every part even when one of them fails. The shape is
contextlib.AsyncExitStack's, with the grace a stop hands its parts; `Together` is aiohttp's
"close every site, then give requests in flight their time": parts that stop at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gemps_server.logs import event

log = logging.getLogger("gemps.server")


class Part(Protocol):
    """One of the server's parts (a door, a background task, the applier, ...)."""

    @property
    def name(self) -> str: ...

    async def start(self) -> None:
        """Take what the part holds (a port, a thread, a directory); raise when it cannot, having
        taken nothing."""
        ...

    async def stop(self, grace: float) -> None:
        """Let go of it; work in flight gets up to `grace` seconds."""
        ...


async def _nothing(*_grace: float) -> None:
    return None


@dataclass(frozen=True)
class Step:
    """A part made of two calls, each optional: most parts are one line where the stack is declared."""

    name: str
    begin: Callable[[], Awaitable[None]] = _nothing
    end: Callable[[float], Awaitable[None]] = _nothing

    async def start(self) -> None:
        await self.begin()

    async def stop(self, grace: float) -> None:
        await self.end(grace)


class Task:
    """A background loop (lease expiry, heap trimming): a task of the server's event loop while the
    server runs, cancelled and waited for when it stops."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self, grace: float) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Together:
    """Parts started in order and stopped at once: in-flight work on each gets the same grace."""

    def __init__(self, name: str, parts: Iterable[Part | None]) -> None:
        self.name = name
        self._parts = Stack(parts)

    async def start(self) -> None:
        await self._parts.start()

    async def stop(self, grace: float) -> None:
        await self._parts.stop(grace, at_once=True)


class Stack:
    """Parts in start order (None: a part this server does not have, e.g. checkpoints off)."""

    def __init__(self, parts: Iterable[Part | None]) -> None:
        self._parts = [part for part in parts if part is not None]
        self._started: list[Part] = []

    async def start(self) -> None:
        """Start each part in order; on a failure, stop those started (no grace) and raise it."""
        for part in self._parts:
            try:
                await part.start()
            except BaseException:
                with contextlib.suppress(Exception):  # logged; the start's own failure is the news
                    await self.stop(0.0)
                raise
            self._started.append(part)

    async def stop(self, grace: float, at_once: bool = False) -> None:
        """Stop the started parts in reverse order (`at_once`: concurrently). Each is stopped even
        when another fails; the first failure is raised once all are."""
        started, self._started = self._started[::-1], []
        if at_once:
            outcomes = await asyncio.gather(*(part.stop(grace) for part in started), return_exceptions=True)
        else:
            outcomes = [await _outcome(part.stop(grace)) for part in started]
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for part, outcome in zip(started, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                event(
                    log,
                    "stop failed",
                    level=logging.ERROR,
                    part=part.name,
                    error=f"{type(outcome).__name__}: {outcome}",
                )
        if failures:
            raise failures[0]


async def _outcome(stopping: Awaitable[None]) -> BaseException | None:
    try:
        await stopping
    except BaseException as error:  # the rest are still let go of; raised by Stack.stop after
        return error
    return None
