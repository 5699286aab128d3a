"""Where each partition is, as partition 0 announces it (DESIGN §3a).

`--partition-addresses` is a comma-separated list in partition order, one address with `{index}`
(a Kubernetes StatefulSet's stable names), or `@PATH`: a file holding either form, which a
launcher rewrites when it restarts a partition on another machine. Partition 0 reads the file again
whenever it changed, so the next Register or Status announces the partition's new address and
clients follow it (gemps.router). A file that cannot be read or lists the wrong number of
addresses leaves the last good list in force, with a warning (at most one a minute).

The file is read only if it is a regular file of at most MAX_FILE_BYTES, opened without blocking,
and, once the server runs, off the event loop: a FIFO put there hung partition 0's gRPC (Status,
health and commits timed out), and a 512 MiB file added 4.3 GiB to it (issue 41, item 8).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

from gemps_server.logs import Throttle

log = logging.getLogger("gemps.server")
FILE_PREFIX = "@"
#: The most a --partition-addresses file may hold: a few thousand addresses. A larger file is
#: refused (the last good list stays), before a byte of it is read.
MAX_FILE_BYTES = 1 << 20
#: How long a Register or Status waits for the file to be read again, at most, before it
#: announces the last good list (a read stuck on a dead network file system holds no reply).
REREAD_WAIT = 1.0
# A file that stays unreadable is said once a minute, with the count of reads left unsaid.
_warnings = Throttle(interval=60.0)


def parse(spec: str, partitions: int) -> tuple[str, ...]:
    """The addresses a list or a pattern names; ValueError when they are not one per partition."""
    if "{index}" in spec:
        return tuple(spec.replace("{index}", str(i)) for i in range(partitions))
    addresses = tuple(address.strip() for address in spec.split(","))
    if len(addresses) != partitions:
        raise ValueError(f"lists {len(addresses)} addresses for {partitions} partitions")
    return addresses


def problems(spec: str, partitions: int) -> list[str]:
    """What is wrong with `--partition-addresses` as given (a file: as it reads now)."""
    try:
        parse(_read(spec), partitions)
    except (OSError, ValueError) as error:
        return [f"partition_addresses {spec!r}: {error}"]
    return []


def _read(spec: str) -> str:
    return read_file(spec[len(FILE_PREFIX) :]).strip() if spec.startswith(FILE_PREFIX) else spec


def read_file(path: str) -> str:
    """The text of `path`, a regular file of at most MAX_FILE_BYTES; OSError or ValueError
    otherwise. Never waits on a writer: a FIFO or a device is refused from its stat before it is
    opened, and again on the descriptor opened (non-blocking: it may have been swapped in between)."""
    _check_regular(path, os.stat(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check_regular(path, os.fstat(fd))
        chunks: list[bytes] = []
        left = MAX_FILE_BYTES + 1  # one byte past the bound tells a file grown since its stat
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path} holds more than {MAX_FILE_BYTES} bytes: not a list of addresses")
    return data.decode()


def _check_regular(path: str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a FIFO, a device or a directory): give a file")
    if info.st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path} has {info.st_size} bytes, more than {MAX_FILE_BYTES}: not a list of addresses")


class PartitionAddresses:
    """The addresses partition 0 announces now (empty when it was given none). A file is read
    once here (a bounded read of a regular file, which does not block), then again by `reread`,
    which the event loop runs in a thread (`refreshed`)."""

    def __init__(self, spec: str, partitions: int) -> None:
        self.spec, self.partitions = spec, partitions
        self._seen: tuple[int, int, int] | None = None  # the file's (inode, mtime_ns, size) when last read
        self._addresses: tuple[str, ...] = () if not spec or spec.startswith(FILE_PREFIX) else parse(spec, partitions)
        self._rereading: asyncio.Future[tuple[str, ...]] | None = None  # the read in a thread, if one runs
        if spec.startswith(FILE_PREFIX):
            self.reread()

    def current(self) -> tuple[str, ...]:
        """The last good list, as it stands (no I/O)."""
        return self._addresses

    async def refreshed(self, wait: float = REREAD_WAIT) -> tuple[str, ...]:
        """The list with the file read again if it changed: in a thread (one at a time), waited
        for at most `wait` seconds; the last good list otherwise."""
        if not self.spec.startswith(FILE_PREFIX):
            return self._addresses
        if self._rereading is None or self._rereading.done():
            self._rereading = asyncio.ensure_future(asyncio.to_thread(self.reread))
        await asyncio.wait({self._rereading}, timeout=wait)
        return self._addresses

    def reread(self) -> tuple[str, ...]:
        """Read the file again if it changed (blocking I/O: off the event loop); the list now."""
        path = self.spec[len(FILE_PREFIX) :]
        try:
            info = os.stat(path)
            seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if seen != self._seen:
                self._addresses = parse(read_file(path).strip(), self.partitions)
                self._seen = seen
        except (OSError, ValueError) as error:
            suppressed = _warnings.allow(path)
            if suppressed is not None:
                log.warning(
                    "partition addresses from %s not read (%s): announcing %s%s",
                    path,
                    error,
                    self._addresses,
                    f" ({suppressed} more failed reads since the last warning)" if suppressed else "",
                )
        return self._addresses
