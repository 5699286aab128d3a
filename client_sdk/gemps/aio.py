"""The asyncio client: `gemps.Client`'s calls as awaitables, for trainers that overlap I/O.

>>> async with AsyncClient("127.0.0.1:50051") as client:
...     await client.register({"w": np.zeros((3, 2), np.float32)})
...     results = await asyncio.gather(*(client.commit(g) for g in gradients))

An `AsyncClient` runs a blocking `Client`'s calls on a thread of its own, one at a time, in the
order they were made: the event loop is never blocked, and the guarantees are the blocking
client's (every answer is its own call's, a commit reported refused was not applied, each
commit's retries reuse its request id). One thread rather than the loop's default executor: the
calls would be serialised by the client's lock anyway (`gemps.serialised`), and a queue of one
thread keeps them in order, where threads racing for that lock would not. Not a transport of its
own: θ crosses the same gRPC, data-plane or shared-memory path as the blocking client's.

A call is queued when it is made (not when it is awaited), and a commit's payload copied then;
its `timeout` (the Client's) counts from then, so it bounds the whole of what the caller awaits,
the wait behind the calls queued before it included: a call whose time is spent before it
starts raises DeadlineExceededError without sending anything.
Cancelling a call that has not started takes it off the queue (nothing was sent); one that has
started runs to its end, as a request on the wire cannot be taken back. `await
client.outcome(call)` then says what the cancelled call did: its result (a commit's CommitResult:
applied, so do not commit that gradient again), the error it ended in, or None when it was taken
off the queue before anything was sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict, TypeVar, cast

from gemps.client import Client
from gemps.records import (
    Buffers,
    CentralVariable,
    CommitResult,
    GradientNoise,
    GradientSums,
    Registration,
    ServerStatus,
)
from gemps.resolver import Target
from gemps.transport import call_deadline
from gemps_proto import vectors
from gemps_proto.vectors import ArrayLike, Vector

if TYPE_CHECKING:
    from typing import Unpack  # 3.11; annotations only

P = ParamSpec("P")
Delta = ArrayLike | Mapping[str, ArrayLike] | Buffers
R = TypeVar("R")


class CommitOptions(TypedDict, total=False):
    """`Client.commit`'s keyword arguments."""

    kind: str
    loss: float | None
    num_samples: int | None
    base_version: int | None
    buffer_delta: Delta | None
    gradient_sums: Sequence[GradientSums] | None


class AsyncClient:
    """A `gemps.Client` whose calls return awaitables: made from `target` and `Client`'s options
    (by keyword), or around a `Client` given, which other threads may use too (closing this
    closes it, and leaving the `async with` leaves it). The client's `timeout` bounds each call
    from when it is made, retries and the wait behind earlier calls included; then it raises
    DeadlineExceededError."""

    def __init__(self, target: Target | Client = "127.0.0.1:50051", **options: Any) -> None:
        if isinstance(target, Client) and options:
            raise TypeError(f"options for a Client already made: {', '.join(sorted(options))}")
        # What it holds (registration, central, planes, ...) is read here, at once: no call.
        self.client = target if isinstance(target, Client) else Client(target, **options)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemps-aio")
        self._closed = False
        # Each awaitable's call on the thread, which runs on when the awaitable is cancelled once
        # started (`outcome`); weak: an awaitable let go of takes its entry with it.
        self._running: weakref.WeakKeyDictionary[asyncio.Future[Any], concurrent.futures.Future[Any]] = (
            weakref.WeakKeyDictionary()
        )

    def _call(self, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]:
        """`call` queued now on the client's thread, after the calls made before it (made from a
        coroutine: the future is the running loop's)."""
        if self._closed:
            raise RuntimeError("this AsyncClient is closed")
        at = time.monotonic() + self.client.timeout  # the call's deadline runs from now
        loop = asyncio.get_running_loop()
        gate = _Gate()
        queued = self._thread.submit(functools.partial(_within, self.client.timeout, at, gate, call, *args, **kwargs))
        # Cancelling it takes `queued` off the queue if it can, from a callback of the loop's: until
        # then the gate stops the thread starting it (the loop may be busy while the thread moves on).
        awaited = cast("asyncio.Future[R]", asyncio.wrap_future(queued, loop=loop))
        gate.awaited = awaited
        self._running[awaited] = queued
        return awaited

    async def outcome(self, call: asyncio.Future[R]) -> R | None:
        """What a call of this client did, cancelled or not: its result once it has ended (a
        commit's CommitResult: it was applied), its error raised, or None when it was cancelled
        before it started (nothing was sent). A commit cancelled after it started is still applied
        as any other; this is how a caller learns so, rather than committing that gradient twice."""
        queued = self._running.get(call)
        if queued is None:
            raise ValueError("not an awaitable of this AsyncClient's calls")
        if queued.cancelled():
            return None
        result = await asyncio.wrap_future(queued)
        return None if isinstance(result, _NotStarted) else result

    # -- the calls: Client's, awaited --------------------------------------------------------------

    def register(
        self, parameters: Mapping[str, ArrayLike], buffers: Mapping[str, ArrayLike] | None = None
    ) -> asyncio.Future[Registration]:
        """As `Client.register`."""
        return self._call(self.client.register, parameters, buffers)

    def pull(self, *, wait: float = 0.0) -> asyncio.Future[CentralVariable]:
        """As `Client.pull`."""
        return self._call(functools.partial(self.client.pull, wait=wait))

    def commit(
        self, payload: ArrayLike | Mapping[str, ArrayLike], /, **options: Unpack[CommitOptions]
    ) -> asyncio.Future[CommitResult]:
        """As `Client.commit`. The payload and delta are copied now: the commit may wait for the
        calls before it while the trainer computes the next gradient in place."""
        delta = options.get("buffer_delta")
        if delta is not None:
            options["buffer_delta"] = _kept_delta(delta)
        return self._call(self.client.commit, _kept(payload), **options)

    def leave(self) -> asyncio.Future[None]:
        """As `Client.leave`."""
        return self._call(self.client.leave)

    def report_evaluation(
        self, version: int, loss: float, accuracy: float, num_samples: int, dataset: str = ""
    ) -> asyncio.Future[None]:
        """As `Client.report_evaluation`."""
        return self._call(self.client.report_evaluation, version, loss, accuracy, num_samples, dataset)

    def status(self) -> asyncio.Future[ServerStatus]:
        """As `Client.status`."""
        return self._call(self.client.status)

    def statuses(self) -> asyncio.Future[list[ServerStatus]]:
        """As `Client.statuses`."""
        return self._call(self.client.statuses)

    def gradient_noise(self, statuses: Sequence[ServerStatus] | None = None) -> asyncio.Future[GradientNoise]:
        """As `Client.gradient_noise`."""
        return self._call(self.client.gradient_noise, statuses)

    async def close(self) -> None:
        """As `Client.close` (leaving first, if still registered), after the calls started before; then the
        client's thread ends. Closing twice does nothing."""
        await self._last(self.client.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Leave (a failure is logged, as `Client`'s `with` does), then close."""
        await self._last(self.client.__exit__, *exc_info)

    async def _last(self, call: Callable[..., None], *args: object) -> None:
        """`call` as the client's last, then its thread ends (once: closed, nothing more is done)."""
        if self._closed:
            return
        try:
            await self._call(call, *args)
        finally:
            self._closed = True
            self._thread.shutdown(wait=False)


class _Gate:
    """The caller's awaitable of a queued call, once made: cancelled, the call is not started."""

    awaited: asyncio.Future[Any] | None = None


class _NotStarted:
    """What a call cancelled before it started returns (only `outcome` sees it: None)."""


def _within(
    timeout: float, at: float, gate: _Gate, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs
) -> R | _NotStarted:
    """`call` within the deadline `at` (of `timeout` seconds): the Client's calls keep it; nothing
    when its awaitable was cancelled before the call's turn came (cancelled() reads one field)."""
    if gate.awaited is not None and gate.awaited.cancelled():
        return _NotStarted()
    with call_deadline(timeout, at):
        return call(*args, **kwargs)


def _kept(values: ArrayLike | Mapping[str, ArrayLike]) -> Vector | dict[str, Vector]:
    """A copy of a commit's payload, as the caller gave it (an array, or arrays by name)."""
    if isinstance(values, Mapping):
        return {name: vectors.copy(vectors.as_numbers(value)) for name, value in values.items()}
    return vectors.copy(vectors.as_numbers(values))


def _kept_delta(delta: Delta) -> Delta:
    """A copy of a commit's buffer delta, as the caller gave it."""
    if isinstance(delta, Buffers):
        return Buffers(vectors.copy(delta.floats), vectors.copy(delta.integers))
    return _kept(delta)
