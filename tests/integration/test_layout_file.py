"""`--partition-addresses @FILE` put to ill use (issue 41, item 8): a FIFO hung partition 0's
gRPC (Status, health, Commit timed out) and a 512 MiB file added 4.3 GiB to it. Partition 0 now
reads only a regular file under a bound, off the event loop, and keeps the last good layout."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gemps
from gemps.retry import NO_RETRY
from gemps_server.config import ServerConfig
from gemps_worker.cluster import ServerProcess
from tests.integration.conftest import StartServer, StartServerProcess

GOOD = ("10.0.0.1:50051", "10.0.0.2:50051")
#: how long a Status may take with a bad file in place (the server reads it at most REREAD_WAIT)
ANSWERS_WITHIN = 3.0


def announced(target: str) -> tuple[tuple[str, ...], float]:
    """The partition addresses partition 0's Status announces, and how long it took to answer."""
    started = time.monotonic()
    with gemps.Client(target, timeout=ANSWERS_WITHIN, retry=NO_RETRY) as client:
        layout = client.status().layout
    assert layout is not None
    return tuple(partition.address for partition in layout.partitions), time.monotonic() - started


def partition_zero(path: Path) -> dict[str, object]:
    path.write_text(",".join(GOOD) + "\n")
    return {"partitions": 2, "partition_index": 0, "partition_addresses": f"@{path}"}


def let_readers_go(path: Path) -> None:
    """Open the FIFO at `path` for writing and close it: a reader blocked on it sees its end."""
    with contextlib.suppress(OSError):  # ENXIO: no reader has it open, nothing is stuck
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@contextlib.contextmanager
def fifo_in_place_of(path: Path, after: float | None = None) -> Iterator[None]:
    """`path` (replaced by) a FIFO nobody writes; its readers let go at the end, or `after` seconds
    (a server blocked reading it then goes on: the test can stop it, or fail rather than hang)."""
    if path.exists():
        path.unlink()
        os.mkfifo(path)
    timer = threading.Timer(after, let_readers_go, (path,)) if after is not None else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        let_readers_go(path)


def test_a_fifo_as_the_layout_file_leaves_status_answering_with_the_last_good_layout(
    start_server: StartServer, tmp_path: Path
) -> None:
    path = tmp_path / "addresses"
    server = start_server(**partition_zero(path))
    assert announced(server.target)[0] == GOOD
    with fifo_in_place_of(path):
        for _ in range(3):  # the first read refused, and every one after it
            addresses, took = announced(server.target)
            assert addresses == GOOD
            assert took < ANSWERS_WITHIN
    path.unlink()
    path.write_text("10.0.0.1:50051,10.0.0.3:50051\n")  # a regular file again: read, announced
    assert announced(server.target)[0] == ("10.0.0.1:50051", "10.0.0.3:50051")


def peak_resident_bytes(server: ServerProcess) -> int:
    """The server process's peak resident memory (VmHWM)."""
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_a_huge_layout_file_is_refused_unread(start_server_process: StartServerProcess, tmp_path: Path) -> None:
    """A 64 MiB file (sparse: zeros) where the list of addresses was: refused from its size, so the
    server's peak memory does not grow by the file's size, and the last good layout stays."""
    path = tmp_path / "addresses"
    server = start_server_process(**partition_zero(path))
    assert announced(server.target)[0] == GOOD
    before = peak_resident_bytes(server)
    huge = tmp_path / "huge"
    with huge.open("wb") as handle:
        handle.truncate(64 << 20)
    huge.replace(path)
    for _ in range(3):
        addresses, took = announced(server.target)
        assert addresses == GOOD and took < ANSWERS_WITHIN
    grew = peak_resident_bytes(server) - before
    assert grew < 16 << 20, f"peak memory grew by {grew >> 20} MiB reading a 64 MiB layout file"


def test_a_fifo_is_refused_at_start_naming_the_option(tmp_path: Path) -> None:
    """Given at start, the FIFO is refused at once (no wait for a writer), the message naming the option."""
    path = tmp_path / "addresses"
    os.mkfifo(path)
    started = time.monotonic()
    with fifo_in_place_of(path, after=ANSWERS_WITHIN):  # a reader stuck on it is let go after that
        with pytest.raises(ValueError, match=r"partition_addresses.*not a regular file"):
            ServerConfig(partitions=2, partition_index=0, partition_addresses=f"@{path}")
        assert time.monotonic() - started < ANSWERS_WITHIN
