"""Which calls the gRPC port takes, and how many at once (DESIGN §3b: memory before trust).

Every call passes here before a byte of its request is read:

- a method that needs a token (everything but health checks) without the right one is refused
  UNAUTHENTICATED (security.py);
- the rest take a place in one of two budgets of calls in progress, or are refused
  RESOURCE_EXHAUSTED: calls that need no token (`grpc.health.v1.Health`) in a small budget of
  their own, `--max-unauthenticated-rpcs`, and everything else in `--max-concurrent-rpcs`.

grpc.aio's own `maximum_concurrent_rpcs` counted every call alike, so with a token configured,
clients without it could hold every place with Health.Watch streams (which never end) and leave
none to the workers (issue 28, item 2). A place is given back when the call's task ends, however
it ends (answered, refused, cancelled, its connection gone): the interceptor runs in that task,
as grpc.aio's own limiter counts calls by theirs. Refusals are counted in
`gemps_refused_requests_total{reason}`; a refusal past --max-concurrent-rpcs carries gRPC's own
words (reasons.BUSY_DETAILS, no label), which clients already retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from gemps_proto.reasons import BUSY_DETAILS, Reason
from gemps_server.logs import Throttle, event
from gemps_server.security import OPEN_METHOD_PREFIXES, UNAUTHENTICATED_REFUSAL, BearerToken, refusal_handler

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]

log = logging.getLogger("gemps.server")
#: what a call that would carry work is answered while the server shuts down
SHUTTING_DOWN = refusal_handler(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", None)


class CallBudget:
    """Up to `limit` calls in progress at once (on the event loop); `idle()` waits for none."""

    def __init__(self, limit: int, refusal: Handler, reason: Reason) -> None:
        self.limit = limit
        self.held = 0
        self.refusal = refusal  # what a call past the limit is answered with
        self.reason = reason  # and counted as
        self._none = asyncio.Event()
        self._none.set()

    def enter(self) -> bool:
        if self.held >= self.limit:
            return False
        self.held += 1
        self._none.clear()
        return True

    def leave(self, _task: object = None) -> None:
        self.held -= 1
        if self.held == 0:
            self._none.set()

    async def idle(self) -> None:
        await self._none.wait()


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """The token check and the two budgets of calls in progress."""

    def __init__(
        self, token: str, max_calls: int, max_unauthenticated: int, on_refused: Callable[[Reason], None]
    ) -> None:
        self._token = BearerToken(token) if token else None
        self.calls = CallBudget(
            max_calls, refusal_handler(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_DETAILS, None), Reason.BUSY
        )
        self.unauthenticated = CallBudget(
            max_unauthenticated,
            refusal_handler(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than {max_unauthenticated} calls that need no token at once (the server's "
                "--max-unauthenticated-rpcs)",
                Reason.UNAUTHENTICATED_LIMIT,
            ),
            Reason.UNAUTHENTICATED_LIMIT,
        )
        self._on_refused = on_refused
        self._log = Throttle(interval=1.0)
        self._closing = False

    def close(self) -> None:
        """Shutting down: from now on, calls that would carry work are refused UNAVAILABLE (clients
        retry elsewhere or later); health checks are still answered, NOT_SERVING."""
        self._closing = True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            budget = self.unauthenticated
        elif self._closing:
            return SHUTTING_DOWN
        elif self._token is None or self._token.authorized(handler_call_details.invocation_metadata):
            budget = self.calls
        else:
            return self._refuse(Reason.UNAUTHENTICATED, method, UNAUTHENTICATED_REFUSAL)
        if not budget.enter():
            return self._refuse(budget.reason, method, budget.refusal)
        call = asyncio.current_task()  # the call's own task: it ends when the call does
        assert call is not None, "grpc.aio runs interceptors in the call's task"
        call.add_done_callback(budget.leave)
        return await continuation(handler_call_details)

    def _refuse(self, reason: Reason, method: str, refusal: Handler) -> Handler:
        self._on_refused(reason)
        suppressed = self._log.allow(reason.value)
        if suppressed is not None:
            event(log, "refused", level=logging.WARNING, reason=reason.value, method=method, suppressed=suppressed)
        return refusal
