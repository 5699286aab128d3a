"""The standard grpc.health.v1 service, whose Watch streams end when the server shuts down.

grpcio-health-checking's asyncio servicer keeps every Watch stream open until its client goes
away: at shutdown, each one counts as an RPC in flight, and the server waits the whole grace
period for it. Here a Watch stream sends NOT_SERVING and then ends (status OK) once the server
is shutting down, so shutdown waits only for real work. Otherwise the same behaviour: Check
answers the status or NOT_FOUND, Watch sends the current status and each change
(SERVICE_UNKNOWN for a service never set), and after `enter_graceful_shutdown` every service is
NOT_SERVING for good.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status = int  # a health_pb2.HealthCheckResponse.ServingStatus


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped generated base
    def __init__(self) -> None:
        self._statuses: dict[str, Status] = {}
        self._changed = asyncio.Condition()
        self._shutting_down = False

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        last: Status | None = None
        while True:
            status = self._status(request.service)
            if status != last:  # written without the lock: a slow reader must not hold set()
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._shutting_down:
                return  # NOT_SERVING was sent: the stream must not hold the shutdown
            async with self._changed:
                while not self._shutting_down and self._status(request.service) == last:
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
