"""gRPC's own log lines, kept to errors unless the user chose otherwise.

gRPC's C core logs at INFO what the SDK already handles: a server closing a connection with an
error code ("Got goaway [2] err=..."), which the client retries. Those lines reached workers' logs
between their own (issue 43, item 7). The core reads GRPC_VERBOSITY once, when grpc is imported,
so importing `gemps` sets it to ERROR first, unless the user set GRPC_VERBOSITY or GRPC_TRACE
themselves (then theirs stands) or imported grpc before gemps (then gRPC's default does).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VERBOSITY, TRACE = "GRPC_VERBOSITY", "GRPC_TRACE"


def quiet(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GRPC_VERBOSITY=ERROR in `environ` (the process's) unless the user set GRPC_VERBOSITY
    or GRPC_TRACE; whether it did."""
    environ = os.environ if environ is None else environ
    if VERBOSITY in environ or TRACE in environ:
        return False
    environ[VERBOSITY] = "ERROR"
    return True


quiet()  # at import: before any module of the SDK imports grpc
