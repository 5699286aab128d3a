"""Open files: the server's budget of file descriptors, and how many client connections fit in it.

Every client connection holds a descriptor, and so do checkpoint files, the metrics endpoint and
gRPC's own wake-up and polling files. With a soft limit of 1024 (the default of many hosts and
container runtimes) 1,100 connections that never send a byte exhausted them: accepts failed and
legitimate workers were locked out for as long as the idle connections stayed. So at start the
soft limit is raised to the hard one (an unprivileged process may), and connections are capped
below it, keeping RESERVED descriptors for everything else (see app.py: gRPC closes connections
past the cap on arrival, and closes those that do not finish their handshake in time or stay
without an RPC).
"""

from __future__ import annotations

import contextlib

#: descriptors kept for all but client connections: checkpoints, metrics, gRPC's own, logs
RESERVED = 64

try:
    import resource
except ImportError:  # not on POSIX: nothing to raise
    resource = None  # type: ignore[assignment]


def raise_open_file_limit() -> int | None:
    """Raise the soft limit on open files to the hard one; the soft limit now (None: unknown)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):  # some systems cap it lower than "infinity"
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def connection_budget(requested: int, open_files: int | None) -> int:
    """The connections to allow: `requested`, capped so RESERVED descriptors stay free."""
    if open_files is None:
        return requested
    return max(1, min(requested, open_files - RESERVED))
