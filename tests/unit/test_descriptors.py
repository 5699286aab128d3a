"""The descriptor reserve (descriptors.py): held on /dev/null, given back while lent, and what it
is for: a file opened when the process's table is full (a real RLIMIT_NOFILE, in a child)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from gemps_server.descriptors import Reserve, exhausted, sparing

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/fd is Linux's")


def devnull_fds() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == os.devnull
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
    return count


def test_the_reserve_holds_its_descriptors_and_gives_them_back_while_lent() -> None:
    before = devnull_fds()
    reserve = Reserve(4)
    assert reserve.held == 4 and devnull_fds() == before + 4
    with reserve.lent() as count:
        assert count == 4 and reserve.held == 0 and devnull_fds() == before
        assert not reserve.refill()  # nothing is taken back while lent
    assert reserve.held == 4 and devnull_fds() == before + 4
    with reserve.lent():
        pass
    assert reserve.refill()


def test_out_of_descriptors_is_told_from_other_failures() -> None:
    assert exhausted(OSError(errno.EMFILE, "Too many open files"))
    assert exhausted(OSError(errno.ENFILE, "Too many open files in system"))
    assert not exhausted(OSError(errno.ENOSPC, "No space left on device"))
    # safetensors (Rust) says it in its message only
    assert exhausted(Exception("Error while serializing: IoError(Too many open files (os error 24))"))
    assert not exhausted(Exception("Error while serializing: IoError(No space left on device (os error 28))"))


def test_sparing_tries_once_more_only_when_out_of_descriptors() -> None:
    calls: list[int] = []

    def once_out() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return "written"

    assert sparing(once_out) == "written" and len(calls) == 2

    def full_disk() -> None:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    calls.clear()
    with pytest.raises(OSError, match="No space"):
        sparing(full_disk)
    assert len(calls) == 1


CHILD = """
import os, resource, socket, sys
from gemps_server.descriptors import reserve, sparing
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
reserve()
held = []
try:
    while True:
        held.append(socket.socket())  # connections take every descriptor left
except OSError:
    pass
path = sys.argv[1]
try:
    open(path, "w").close()
    print("opened without the reserve")
except OSError:
    pass
sparing(lambda: open(path, "w").close())
print("opened with the reserve", reserve().held)
"""


def test_a_file_opens_with_the_reserve_when_the_table_is_full(tmp_path: os.PathLike[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, os.path.join(tmp_path, "file")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    # Not opened without it; opened with it, and the reserve whole again after.
    assert result.stdout.splitlines() == ["opened with the reserve 16"]
