"""Flags for reaching a server that requires TLS or a token (defaults: GEMPS_* variables, as the SDK)."""

from __future__ import annotations

import argparse

from gemps.client import Client
from gemps.retry import RetryPolicy


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection (defaults from GEMPS_AUTH_TOKEN, GEMPS_TLS_* variables)")
    group.add_argument("--token", default=None, help="bearer token (env GEMPS_AUTH_TOKEN)")
    group.add_argument("--tls", action="store_true", default=None, help="use TLS (env GEMPS_TLS)")
    group.add_argument("--tls-ca", default=None, help="PEM CA to verify the server; implies --tls (env GEMPS_TLS_CA)")
    group.add_argument(
        "--tls-client-cert", default=None, help="PEM client certificate for mutual TLS (env GEMPS_TLS_CLIENT_CERT)"
    )
    group.add_argument("--tls-client-key", default=None, help="PEM key of --tls-client-cert (env GEMPS_TLS_CLIENT_KEY)")
    group.add_argument(
        "--tls-server-name", default=None, help="name expected in the server's certificate (env GEMPS_TLS_SERVER_NAME)"
    )


def connect(args: argparse.Namespace, timeout: float, retry: RetryPolicy | None = None) -> Client:
    """A Client for `args.server` with the connection flags."""
    return Client(
        args.server,
        timeout=timeout,
        retry=retry,
        token=args.token,
        tls=args.tls,
        ca_cert=args.tls_ca,
        client_cert=args.tls_client_cert,
        client_key=args.tls_client_key,
        server_name=args.tls_server_name,
    )
