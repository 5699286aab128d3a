"""Which calls the gRPC port takes, and how many at once (DESIGN §3b: memory before trust).

Every call passes here before a byte of its request is read:

- a method that needs a token (everything but health checks) without the right one is refused
  UNAUTHENTICATED (security.py);
- with --tls-crl, a call over a connection whose client certificate the list revokes (or a CA of
  the chain it presented) is refused UNAUTHENTICATED (revocation.py) before its handler runs, the
  connection's every call, so one open before the revocation too: grpcio takes no CRL and tells
  an interceptor nothing of the connection, so the handler is wrapped to look at the call's own
  certificates first;
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
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from gemps_proto.reasons import BUSY_DETAILS, Reason
from gemps_proto.reasons import METADATA_KEY as REASON_KEY
from gemps_server.logs import Throttle, event
from gemps_server.security import (
    OPEN_METHOD_PREFIXES,
    UNAUTHENTICATED_REFUSAL,
    BearerToken,
    call_certificates,
    refusal_handler,
)

if TYPE_CHECKING:
    from gemps_server.revocation import Revocations

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
        self,
        token: str,
        max_calls: int,
        max_unauthenticated: int,
        on_refused: Callable[[Reason], None],
        revocations: Revocations | None = None,
    ) -> None:
        self._token = BearerToken(token) if token else None
        self._revocations = revocations
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
        handler = await continuation(handler_call_details)
        if self._revocations is None or handler is None:
            return handler
        return revocation_guarded(handler, self._revocation_check(method))

    def _revocation_check(self, method: str) -> Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]:
        revocations = self._revocations
        assert revocations is not None

        async def check(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            refusal = revocations.refusal(*call_certificates(context))
            if refusal:
                self._count(Reason.REVOKED_CERTIFICATE, method, refusal)
                trailing = ((REASON_KEY, Reason.REVOKED_CERTIFICATE.value),)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal, trailing_metadata=trailing)

        return check

    def _refuse(self, reason: Reason, method: str, refusal: Handler) -> Handler:
        self._count(reason, method)
        return refusal

    def _count(self, reason: Reason, method: str, detail: str = "") -> None:
        """A refusal counted, and logged at most once a second of each reason."""
        self._on_refused(reason)
        suppressed = self._log.allow(reason.value)
        if suppressed is not None:
            event(log, "refused", level=logging.WARNING, reason=reason.value, method=method,
                  detail=detail or None, suppressed=suppressed)  # fmt: skip


def revocation_guarded(
    handler: Handler, check: Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]
) -> Handler:
    """`handler` with `check(context)` (which aborts the call) awaited before its behaviour runs."""
    if handler.unary_unary is not None or handler.stream_unary is not None:
        inner: Any = handler.unary_unary or handler.stream_unary

        async def unary_reply(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await check(context)
            return await inner(request, context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary_reply, handler.request_deserializer, handler.response_serializer)
    streaming: Any = handler.unary_stream or handler.stream_stream
    if inspect.isasyncgenfunction(streaming):

        async def replies(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await check(context)
            async for reply in streaming(request, context):
                yield reply

        behaviour: Any = replies
    else:  # a coroutine that writes its replies with context.write

        async def writes(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await check(context)
            return await streaming(request, context)

        behaviour = writes
    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(behaviour, handler.request_deserializer, handler.response_serializer)
