"""The GEMPS_* variables the SDK reads by itself: defaults of its options, for workers configured
through their environment (containers, Kubernetes). Each is read where its option is resolved
(channel_security, retry, wire_options, pytorch.threads); this table names them together, with the
argument each stands for, for the generated reference and for --strict-env (gemps_cli.environment).
tests/unit/test_sdk_variables.py keeps it equal to the names those modules read."""

from __future__ import annotations

from collections.abc import Mapping

#: variable -> the argument it is the default of
READ_BY_THE_SDK: Mapping[str, str] = {
    "GEMPS_AUTH_TOKEN": "Client(token=)",
    "GEMPS_AUTH_TOKEN_FILE": "Client(token=)",  # the token, read from the file
    "GEMPS_TLS": "Client(tls=)",
    "GEMPS_TLS_CA": "Client(ca_cert=)",
    "GEMPS_TLS_CLIENT_CERT": "Client(client_cert=)",
    "GEMPS_TLS_CLIENT_KEY": "Client(client_key=)",
    "GEMPS_TLS_SERVER_NAME": "Client(server_name=)",
    "GEMPS_PATIENCE": "Client(patience=)",
    "GEMPS_PLANE": "Client(plane=)",
    "GEMPS_SHARED_MEMORY": "Client(shared_memory=)",
    "GEMPS_THREADS": "RemoteOptimizer(threads=)",  # and RemoteModel's
}


def reader(name: str) -> str:
    """Who reads `name`, as the reference says it: "the SDK: `Client(ca_cert=)`"."""
    return f"the SDK: `{READ_BY_THE_SDK[name]}`"
