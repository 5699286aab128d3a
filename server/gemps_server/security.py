"""The ports' defences: TLS (optionally mutual), bearer-token auth, registration rate limit, and the
data plane's tickets.

- TLS: `--tls-cert`/`--tls-key` (PEM); with `--tls-client-ca` clients must present a certificate
  signed by that CA (mutual TLS), or the handshake fails.
- Token: with `--auth-token`, every RPC must carry `authorization: Bearer <token>`; the
  comparison is constant-time (hmac.compare_digest). `grpc.health.v1.Health` stays open so
  container and Kubernetes health probes, which cannot send headers, keep working: it reveals
  only whether the server is serving.
- Registrations: a token bucket of `--max-registrations-per-minute` (bursts up to that many).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from gemps_proto import reasons
from gemps_server.logs import Throttle, event

log = logging.getLogger("gemps.server")

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "
# Methods open without a token: health checks only.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with `client_ca`, client certificates are required."""
    chain = Path(cert).read_bytes()
    private_key = Path(key).read_bytes()
    root = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=root, require_client_auth=bool(root))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost, or a wildcard such as 0.0.0.0 / ::


def exposure_warnings(host: str, tls: bool, token: bool) -> list[str]:
    """What to warn about for a listener on `host` with or without TLS and a token."""
    if is_loopback(host):
        return []
    if not tls and not token:
        return [
            f"listening on {host} beyond loopback with NEITHER TLS NOR a token: anyone who can reach this "
            "port can read and overwrite the model; set --auth-token (and --tls-cert/--tls-key), or --host 127.0.0.1"
        ]
    if not tls:
        return [f"listening on {host} without TLS: the bearer token and the model travel in clear text"]
    return []


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses any RPC (health checks aside) without `authorization: Bearer <token>`."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None) -> None:
        self._expected = (BEARER_PREFIX + token).encode()
        self._on_refused = on_refused
        self._log = Throttle(interval=1.0)

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        presented = [value for key, value in metadata or () if key == AUTHORIZATION_KEY]
        if len(presented) != 1:
            return False
        value = presented[0]
        raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(raw, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES) or self.authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        if self._on_refused is not None:
            self._on_refused(method)
        suppressed = self._log.allow(method)
        if suppressed is not None:
            event(log, "unauthenticated", level=logging.WARNING, method=method, suppressed=suppressed)
        # Refused by a handler that takes a stream of requests and reads none of it: with the
        # method's own unary handler grpc.aio would first receive the whole request (up to
        # --max-message-mb: the window opens to the length it declares) and only then refuse.
        # On the wire the refusal is the same status whatever the method's shape.
        return _REFUSAL


async def _deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong bearer token: send 'authorization: Bearer <token>'",
        trailing_metadata=((reasons.METADATA_KEY, reasons.Reason.UNAUTHENTICATED.value),),
    )


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await _deny(request, context)
    yield  # pragma: no cover (abort raised)


#: answers UNAUTHENTICATED at once: request-streaming, so grpc.aio reads no request message first
_REFUSAL: Handler = grpc.stream_stream_rpc_method_handler(_deny_stream)


class RateLimiter:
    """A token bucket: `capacity` calls at once, refilled at `capacity` per `period` seconds."""

    def __init__(self, capacity: int, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate = capacity / period if capacity else 0.0
        self._clock = clock
        self._tokens = float(capacity)
        self._updated = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        if self.capacity <= 0:
            return True  # no limit
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
            self._updated = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


class Tickets:
    """Data-plane tickets (DESIGN §3c): HMAC-SHA256 of a worker id and its client id under a key
    drawn at random when the process starts, so only this process can issue them, a ticket
    proves one registration, and none outlives the process. Compared in constant time."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def issue(self, worker_id: str, client_id: str) -> bytes:
        message = f"{worker_id}\0{client_id}".encode("utf-8", "surrogateescape")
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def valid(self, ticket: bytes, worker_id: str, client_id: str) -> bool:
        return hmac.compare_digest(ticket, self.issue(worker_id, client_id))
