"""Container health check: ask a gemps server's standard grpc.health.v1 service.

Exits 0 when the service answers SERVING and 1 otherwise, as Docker's HEALTHCHECK, a compose
`healthcheck` and Kubernetes exec probes expect. It needs only grpcio and grpcio-health-checking,
which every gemps image already has, so there's no grpc_health_probe binary to download.

    python healthcheck.py                # this container's own server: 127.0.0.1:$GEMPS_PORT
    python healthcheck.py --upstream     # the server this worker trains against: $GEMPS_SERVER
    python healthcheck.py --target HOST:PORT [--service NAME] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

SERVICE = "gemps.v1.ParameterServer"
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def own_target(environ: Mapping[str, str]) -> str:
    """The address of the server running in this container (it usually listens on 0.0.0.0)."""
    host = environ.get("GEMPS_HOST", "")
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{environ.get('GEMPS_PORT', '50051')}"


def check(target: str, service: str, timeout: float) -> str:
    """The serving status of `service` at `target`, as a name (SERVING, NOT_SERVING, ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
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
    try:
        status = check(target, args.service, args.timeout)
    except Exception as error:  # any failure to get an answer means unhealthy
        code = getattr(error, "code", None)
        reason = code().name if callable(code) else type(error).__name__
        print(f"unhealthy: {target} {args.service!r}: {reason}")
        return 1
    print(f"{target} {args.service!r}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
