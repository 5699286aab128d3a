"""Binding a listener, said the same way for every port the server opens (gRPC, the data plane,
metrics, replication): `host:port` written once, and a failure named by listener and address."""

from __future__ import annotations

import errno
from collections.abc import Callable


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening(what: str, host: str, port: int, start: Callable[[], int]) -> int:
    """`start()` (which binds `host`:`port`), its bound port; its OSError said in one line
    that names the listener and the address."""
    try:
        return start()
    except OSError as error:
        hint = " (is another server listening there?)" if error.errno == errno.EADDRINUSE else ""
        reason = error.strerror or str(error)
        raise OSError(f"{what}: cannot listen on {hostport(host, port)}: {reason}{hint}") from None
