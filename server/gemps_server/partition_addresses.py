"""Where each partition is, as partition 0 announces it (DESIGN §3a).

`--partition-addresses` is a comma-separated list in partition order, one address with `{index}`
(a Kubernetes StatefulSet's stable names), or `@PATH`: a file holding either form, which a
launcher rewrites when it restarts a partition on another machine. Partition 0 reads the file again
whenever it changed, so the next Register or Status announces the partition's new address and
clients follow it (gemps.router). A file that cannot be read or lists the wrong number of
addresses leaves the last good list in force, with a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("gemps.server")
FILE_PREFIX = "@"


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
    return Path(spec[len(FILE_PREFIX) :]).read_text().strip() if spec.startswith(FILE_PREFIX) else spec


class PartitionAddresses:
    """The addresses partition 0 announces now (empty when it was given none)."""

    def __init__(self, spec: str, partitions: int) -> None:
        self.spec, self.partitions = spec, partitions
        self._seen: tuple[int, int] | None = None  # the file's (mtime_ns, size) when last read
        self._addresses: tuple[str, ...] = () if not spec or spec.startswith(FILE_PREFIX) else parse(spec, partitions)

    def current(self) -> tuple[str, ...]:
        if self.spec.startswith(FILE_PREFIX):
            self._reread()
        return self._addresses

    def _reread(self) -> None:
        path = self.spec[len(FILE_PREFIX) :]
        try:
            info = os.stat(path)
            if (info.st_mtime_ns, info.st_size) == self._seen:
                return
            self._addresses = parse(_read(self.spec), self.partitions)
            self._seen = (info.st_mtime_ns, info.st_size)
        except (OSError, ValueError) as error:
            log.warning("partition addresses from %s not read (%s): announcing %s", path, error, self._addresses)
