"""Open files: the server's budget of file descriptors, and how many client connections fit in it.

Every client connection holds a descriptor, and so do checkpoint files, the metrics endpoint and
gRPC's own wake-up and polling files. With a soft limit of 1024 (the default of many hosts and
container runtimes) 1,100 connections that never send a byte exhausted them: accepts failed and
legitimate workers were locked out for as long as the idle connections stayed. So at start the
soft limit is raised to the hard one (an unprivileged process may), and connections are capped
below it, keeping RESERVED descriptors for everything else (see app.py: gRPC closes connections
past the cap on arrival, and closes those that do not finish their handshake in time or stay
without an RPC).

That cap is gRPC's; data-plane connections have their own (--max-data-connections), and a
process can be started with any limit. So the table can still run full, and what must never fail
for want of a descriptor has a reserve of its own (issue 42): SPARE descriptors held open on
/dev/null from the start (`reserve()`). A checkpoint that fails with EMFILE is tried again with
them given back (`sparing`), the final one included; and the data plane accepts a connection only
while the reserve is whole (data_plane.py), so its connections never take those descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

#: descriptors kept for all but client connections: checkpoints, metrics, gRPC's own, logs
RESERVED = 64
#: descriptors held on /dev/null for when the table is full: a checkpoint needs one or two at a
#: time (its file, its directory's fsync), with room to spare for the threads shutdown starts
SPARE = 16
# What an open, accept or socket call answers when no descriptor is left (the process's table,
# the system's) or no memory for one.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

T = TypeVar("T")

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


def exhausted(error: BaseException) -> bool:
    """Whether `error` is a call that failed for want of a descriptor (safetensors, in Rust,
    reports the OS error in its message only)."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in EXHAUSTED
    return any(f"(os error {number})" in str(error) for number in (errno.EMFILE, errno.ENFILE))


class Reserve:
    """SPARE descriptors on /dev/null, given back while `lent()` and taken again after. Thread-
    safe: the checkpoint writer lends them from its thread while the data plane's refills them."""

    def __init__(self, count: int = SPARE) -> None:
        self.count = count
        self._fds: list[int] = []
        self._lent = 0  # lend() calls in progress: nothing is taken back meanwhile
        self._lock = threading.Lock()
        self.refill()

    @property
    def held(self) -> int:
        return len(self._fds)

    def refill(self) -> bool:
        """Take back what is missing, as far as descriptors are free; whether the reserve is whole
        (False while it is lent)."""
        with self._lock:
            if self._lent:
                return False
            while len(self._fds) < self.count:
                try:
                    self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
                except OSError:  # none free now: the next refill tries again
                    return False
            return True

    @contextlib.contextmanager
    def lent(self) -> Iterator[int]:
        """Give every spare descriptor back for the block (yields how many), then take them again."""
        with self._lock:
            self._lent += 1
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        try:
            yield len(fds)
        finally:
            with self._lock:
                self._lent -= 1
            self.refill()


_reserve: Reserve | None = None
_reserve_lock = threading.Lock()


def reserve() -> Reserve:
    """The process's reserve (the descriptor table is the process's), taken at the first call."""
    global _reserve
    with _reserve_lock:
        if _reserve is None:
            _reserve = Reserve()
        return _reserve


def sparing(call: Callable[[], T]) -> T:
    """`call()`; when it fails for want of a descriptor, once more with the reserve given back."""
    try:
        return call()
    except Exception as error:
        if not exhausted(error):
            raise
    with reserve().lent():
        return call()
