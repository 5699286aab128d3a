"""One server per checkpoint directory (gemps_server.directory_lock): held, refused, released,
and recovered from a holder that died."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gemps_server.directory_lock import LOCK_NAME, DirectoryInUse, DirectoryLock


def test_a_held_directory_is_refused_naming_its_holder_until_released(tmp_path: Path) -> None:
    first = DirectoryLock(tmp_path / "ckpt")
    assert first.acquire() is None and first.held
    assert (tmp_path / "ckpt" / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    with pytest.raises(DirectoryInUse, match=f"in use by another gemps server \\(pid {os.getpid()},"):
        DirectoryLock(tmp_path / "ckpt").acquire()  # a second holder, even in the same process
    first.release()
    second = DirectoryLock(tmp_path / "ckpt")
    assert second.acquire() is None  # released cleanly: nothing to recover
    second.release()


def test_the_lock_of_a_holder_that_died_is_recovered(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("999999999\n")  # left by a holder SIGKILLed: the file, no lock
    lock = DirectoryLock(tmp_path)
    assert lock.acquire() == "recovered the lock of pid 999999999, which is gone"
    assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    lock.release()
