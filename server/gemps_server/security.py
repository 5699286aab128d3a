"""The ports' defences: TLS (optionally mutual), bearer-token auth, registration rate limit, and the
data plane's tickets.

- TLS: `--tls-cert`/`--tls-key` (PEM); with `--tls-client-ca` clients must present a certificate
  signed by that CA (mutual TLS), or the handshake fails.
- Token: with `--auth-token`, every RPC must carry `authorization: Bearer <token>`; the
  comparison is constant-time (hmac.compare_digest). `grpc.health.v1.Health` stays open so
  container and Kubernetes health probes, which cannot send headers, keep working: it reveals
  only whether the server is serving.
- Registrations: a token bucket of `--max-registrations-per-minute` (bursts up to that many).
- Revoked certificates: `--tls-crl`'s lists (revocation.py), the same on every listener.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from gemps_proto import reasons
from gemps_server.token_bucket import TokenBucket

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "
# Methods open without a token: health checks only (admission.py gives them their own budget).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

if TYPE_CHECKING:
    from gemps_server.revocation import Revocations

    Handler = grpc.RpcMethodHandler[Any, Any]


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with `client_ca`, client certificates are required."""
    chain = Path(cert).read_bytes()
    private_key = Path(key).read_bytes()
    root = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=root, require_client_auth=bool(root))


def tls_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """The gRPC port's TLS, for a plain socket (the data plane, the replication listener): the same
    chain and key, and with `client_ca`, client certificates signed by it required (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(cafile=str(Path(client_ca)))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def revocations(crl: str, ca: str) -> Revocations | None:
    """The process's one reader of the revocation list `crl` (of the CA bundle `ca`); None without
    one. Imported here, only then: cryptography, which parses the lists, was a tenth of the start-up
    of a server that has none."""
    if not crl:
        return None
    from gemps_server.revocation import revocations_for

    return revocations_for(crl, ca)


def call_certificates(context: grpc.aio.ServicerContext[Any, Any]) -> tuple[bytes, ...]:
    """What the client of a gRPC call presented over TLS, its own certificate first, then the rest
    of its chain (PEM; grpcio shows the peer's certificates, not the path it was verified by)."""
    properties = context.auth_context()
    return tuple(blob for key in ("x509_pem_cert", "x509_pem_cert_chain") for blob in properties.get(key) or ())


def presented_by(sock: ssl.SSLSocket) -> tuple[bytes, ...]:
    """The certificates a TLS peer was verified by, its own first (DER): the whole path to the CA
    where Python shows it (public from 3.13; the same method of the ssl object before), its own
    alone otherwise."""
    public = getattr(sock, "get_verified_chain", None)
    if public is not None:  # Python 3.13+: DER bytes
        return tuple(bytes(certificate) for certificate in public())
    native = getattr(sock, "_sslobj", None)
    if native is not None and hasattr(native, "get_verified_chain"):  # 3.10-3.12: _ssl.Certificate objects
        return tuple(certificate.public_bytes(ssl._ssl.ENCODING_DER) for certificate in native.get_verified_chain())  # type: ignore[attr-defined]
    own = sock.getpeercert(binary_form=True)
    return (own,) if own else ()


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


class BearerToken:
    """The token every RPC but a health check must carry: `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = (BEARER_PREFIX + token).encode()

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        presented = [value for key, value in metadata or () if key == AUTHORIZATION_KEY]
        if len(presented) != 1:
            return False
        value = presented[0]
        raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(raw, self._expected)


def refusal_handler(code: grpc.StatusCode, details: str, reason: reasons.Reason | None) -> Handler:
    """A handler that refuses a call at once with `code`, `details` and `reason` (none: no label).

    Request-streaming, for every method: grpc.aio calls it without reading the request, whereas
    with the method's own unary handler it would first receive the whole request (up to
    --max-message-mb: the window opens to the length it declares) and only then refuse. On the
    wire a status-only reply is the same whatever the method's shape."""
    trailing = ((reasons.METADATA_KEY, reason.value),) if reason is not None else ()

    async def refuse(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, details, trailing_metadata=trailing)
        yield  # pragma: no cover (abort raised)

    return grpc.stream_stream_rpc_method_handler(refuse)


#: answers UNAUTHENTICATED at once, reading nothing of the request
UNAUTHENTICATED_REFUSAL = refusal_handler(
    grpc.StatusCode.UNAUTHENTICATED,
    "missing or wrong bearer token: send 'authorization: Bearer <token>'",
    reasons.Reason.UNAUTHENTICATED,
)


class RateLimiter(TokenBucket):
    """A token bucket of `capacity` calls at once, refilled at `capacity` per `period` seconds
    (capacity 0: no limit)."""

    def __init__(self, capacity: int, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity / period if capacity > 0 else 0.0, capacity, clock)


class Tickets:
    """Data-plane tickets (DESIGN §3c): HMAC-SHA256 of a worker id and its client id under a key
    drawn at random when the process starts, so only this process can issue them, a ticket
    proves one registration, and none outlives the process. Compared in constant time. The
    replicas of a partition share one key (a backup adopts its primary's when seeded, DESIGN §3d),
    as they share registrations: a worker's ticket still opens the data plane after a failover."""

    KEY_BYTES = 32

    def __init__(self) -> None:
        self._key = secrets.token_bytes(self.KEY_BYTES)

    @property
    def key(self) -> bytes:
        return self._key

    def adopt(self, key: bytes) -> None:
        """Issue and check tickets under `key` from now on (a primary's, sent with its seed)."""
        if len(key) != self.KEY_BYTES:
            raise ValueError(f"a ticket key is {self.KEY_BYTES} bytes, not {len(key)}")
        self._key = bytes(key)

    def issue(self, worker_id: str, client_id: str) -> bytes:
        message = f"{worker_id}\0{client_id}".encode("utf-8", "surrogateescape")
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def valid(self, ticket: bytes, worker_id: str, client_id: str) -> bool:
        return hmac.compare_digest(ticket, self.issue(worker_id, client_id))
