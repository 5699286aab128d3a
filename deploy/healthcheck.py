"""Container health check: ask a gemps server's standard grpc.health.v1 service.

Exits 0 when the service answers SERVING and 1 otherwise, as Docker's HEALTHCHECK, a compose
`healthcheck` and Kubernetes exec probes expect. It needs only grpcio and grpcio-health-checking,
which every gemps image already has, so there's no grpc_health_probe binary to download.

    python healthcheck.py                # this container's own server: 127.0.0.1:$GEMPS_PORT
    python healthcheck.py --upstream     # the server this worker trains against: $GEMPS_SERVER
                                         # (a replica set "a:50051|b:50051": healthy when one serves)
    python healthcheck.py --target HOST:PORT [--service NAME] [--timeout SECONDS]

TLS comes from the same environment as the process being checked, so a TLS-enabled server is
asked over TLS: for its own server, TLS when GEMPS_TLS_CERT is set, trusting GEMPS_TLS_CA if
given, else the server's own certificate file (a self-signed one, or a chain ending in its CA);
with mutual TLS (GEMPS_TLS_CLIENT_CA) it presents GEMPS_TLS_CLIENT_CERT/KEY if given, else the
server's own certificate and key. For --upstream and --target, the SDK's variables: GEMPS_TLS=1,
GEMPS_TLS_CA, GEMPS_TLS_CLIENT_CERT, GEMPS_TLS_CLIENT_KEY. GEMPS_TLS_SERVER_NAME overrides the
name checked against the certificate. The health service needs no token; GEMPS_AUTH_TOKEN (or
GEMPS_AUTH_TOKEN_FILE) is sent when set, for proxies that want one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SERVICE = "gemps.v1.ParameterServer"
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def own_target(environ: Mapping[str, str]) -> str:
    """The address of the server running in this container (it usually listens on 0.0.0.0)."""
    host = environ.get("GEMPS_HOST", "")
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{environ.get('GEMPS_PORT', '50051')}"


@dataclass(frozen=True)
class Tls:
    """PEM bytes for a TLS channel (root None: the system's roots)."""

    root: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def tls_settings(environ: Mapping[str, str], own: bool) -> Tls | None:
    """TLS for the check from the checked process's environment (None: plaintext): the server's
    variables for its own server (`own`), the SDK's otherwise."""
    server_name = environ.get("GEMPS_TLS_SERVER_NAME", "")
    client_cert, client_key = environ.get("GEMPS_TLS_CLIENT_CERT"), environ.get("GEMPS_TLS_CLIENT_KEY")
    if own:
        server_cert = environ.get("GEMPS_TLS_CERT")
        if not server_cert:
            return None
        mutual = bool(environ.get("GEMPS_TLS_CLIENT_CA"))
        return Tls(
            root=_read(environ.get("GEMPS_TLS_CA") or server_cert),
            cert=_read(client_cert or (server_cert if mutual else None)),
            key=_read(client_key or (environ.get("GEMPS_TLS_KEY") if mutual else None)),
            server_name=server_name,
        )
    if not (_flag(environ.get("GEMPS_TLS", "")) or environ.get("GEMPS_TLS_CA") or client_cert):
        return None
    return Tls(_read(environ.get("GEMPS_TLS_CA")), _read(client_cert), _read(client_key), server_name)


def token(environ: Mapping[str, str]) -> str:
    path = environ.get("GEMPS_AUTH_TOKEN_FILE")
    return Path(path).read_text().strip() if path else environ.get("GEMPS_AUTH_TOKEN", "")


def check(target: str, service: str, timeout: float, tls: Tls | None = None, bearer: str = "") -> str:
    """The serving status of `service` at `target`, as a name (SERVING, NOT_SERVING, ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(tls.root, tls.key, tls.cert)
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        channel = grpc.secure_channel(target, credentials, options=options)
    metadata = (("authorization", f"Bearer {bearer}"),) if bearer else None
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=metadata
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ask a gemps server's grpc.health.v1 service; exit 0 when SERVING.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", help="HOST:PORT to ask (default: this container's server)")
    where.add_argument("--upstream", action="store_true", help="ask $GEMPS_SERVER, the server a worker uses")
    parser.add_argument("--service", default=SERVICE, help=f"service name to ask about (default {SERVICE})")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    if args.target:
        target = args.target
    elif args.upstream:
        target = os.environ.get("GEMPS_SERVER", "127.0.0.1:50051")
    else:
        target = own_target(os.environ)
    # A replicated partition's replicas, "a|b" (docs/CONTAINERS.md): the worker trains as long as
    # one of them serves (a backup's health says SERVING too; the SDK finds the primary).
    exit_status = 1
    for replica in target.split("|"):
        try:
            tls = tls_settings(os.environ, own=not (args.target or args.upstream))
            status = check(replica, args.service, args.timeout, tls, token(os.environ))
        except Exception as error:  # any failure to get an answer means unhealthy
            code = getattr(error, "code", None)
            reason = code().name if callable(code) else type(error).__name__
            print(f"unhealthy: {replica} {args.service!r}: {reason}")
            continue
        print(f"{replica} {args.service!r}: {status}")
        if status == "SERVING":
            exit_status = 0
            break
    return exit_status


if __name__ == "__main__":
    sys.exit(main())
