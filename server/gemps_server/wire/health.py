"""The standard grpc.health.v1 service, whose Watch streams are bounded and end when the server shuts down.

grpcio-health-checking's asyncio servicer keeps every Watch stream open until its client goes
away: at shutdown, each one counts as an RPC in flight, and the server waits the whole grace
period for it. Here a Watch stream sends NOT_SERVING and then ends (status OK) once the server
is shutting down, so shutdown waits only for real work. A Watch needs no token and never ends
by itself, so they are bounded: at most `max_watches` open at once, `per_connection` of them on
one connection (more are refused RESOURCE_EXHAUSTED, reason `watch_limit`); all health calls
together are bounded by the server's --max-unauthenticated-rpcs (admission.py).

Otherwise the same behaviour: Check answers the status or NOT_FOUND, Watch sends the current
status and each change (SERVICE_UNKNOWN for a service never set), and after
`enter_graceful_shutdown` every service is NOT_SERVING for good.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gemps_proto import reasons
from gemps_proto.reasons import Reason

Status = int  # a health_pb2.HealthCheckResponse.ServingStatus
# At shutdown, how long Watch streams get to take their last message (NOT_SERVING) and end, once
# the calls that carry work are done: a client that reads takes it within milliseconds, and one
# that never reads would hold the shutdown for the whole grace period (issue 28, item 4).
FAREWELL_SECONDS = 1.0
Context = grpc.aio.ServicerContext[Any, Any]


class WatchCount:
    """Watch streams open, in total and per connection (a call's peer: its client's address and
    port, one per connection); `none()` waits until no stream is open."""

    def __init__(self, limit: int, per_connection: int) -> None:
        self.limit = limit
        self.per_connection = per_connection
        self._open: Counter[str] = Counter()
        self._none = asyncio.Event()
        self._none.set()

    @property
    def total(self) -> int:
        return self._open.total()

    def open(self, peer: str) -> bool:
        """Count a new stream on `peer`'s connection; False (not counted) past either limit."""
        if self.total >= self.limit or self._open[peer] >= self.per_connection:
            return False
        self._open[peer] += 1
        self._none.clear()
        return True

    def close(self, peer: str) -> None:
        self._open[peer] -= 1
        if self._open[peer] <= 0:
            del self._open[peer]
        if not self._open:
            self._none.set()

    async def none(self) -> None:
        await self._none.wait()


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped generated base
    def __init__(
        self, max_watches: int, per_connection: int, on_refused: Callable[[Reason], None] = lambda _reason: None
    ) -> None:
        self._statuses: dict[str, Status] = {}
        self._changed = asyncio.Condition()
        self._shutting_down = False
        self.watches = WatchCount(max_watches, per_connection)
        self._on_refused = on_refused

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Context) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Context) -> None:
        peer = context.peer()
        if not self.watches.open(peer):
            self._on_refused(Reason.WATCH_LIMIT)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many Health.Watch streams (the server's --max-watches {self.watches.limit}, "
                f"--max-watches-per-connection {self.watches.per_connection})",
                trailing_metadata=((reasons.METADATA_KEY, Reason.WATCH_LIMIT.value),),
            )
        try:
            await self._watch(request.service, context)
        finally:
            self.watches.close(peer)

    async def _watch(self, service: str, context: Context) -> None:
        last: Status | None = None
        while True:
            status = self._status(service)
            if status != last:  # written without the lock: a slow reader must not hold set()
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
                continue  # it may have changed while the write waited: NOT_SERVING must go out
            if self._shutting_down:
                return  # NOT_SERVING was sent: the stream must not hold the shutdown
            async with self._changed:
                while not self._shutting_down and self._status(service) == last:
                    await self._changed.wait()

    def _status(self, service: str) -> Status:
        unknown: Status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        return self._statuses.get(service, unknown)

    async def set(self, service: str, status: Status) -> None:
        """Set a service's status (ignored once shutting down)."""
        if not self._shutting_down:
            await self._set({service: status})

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good; Watch streams send it and end."""
        if self._shutting_down:
            return
        self._shutting_down = True
        await self._set(dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _set(self, statuses: dict[str, Status]) -> None:
        async with self._changed:
            self._statuses.update(statuses)
            self._changed.notify_all()
