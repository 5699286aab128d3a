"""One server per checkpoint directory: a lock file that names its holder's process id.

Two servers writing checkpoints into one directory overwrite each other's history, and the next
start restores whichever wrote last: a new supervisor started beside the orphaned partitions of a
killed one did exactly that (issue 28, item 1). So a server (and `gemps server --partitions K`,
for the directory that holds its partitions' folders) takes `DIR/gemps.lock` before it touches
anything in DIR, and a second one is refused with the holder's pid.

The lock is `flock` on that file, not the file's existence: the kernel drops it when its holder
exits, however it exits (SIGKILL too), so a lock left behind by a dead server is recovered by the
next one without guessing from a pid that may have been reused. The pid is written into the file
for the refusal's message, and a start that finds a dead holder's pid there logs it. On a file
system that cannot lock files the server warns and goes on without the guard.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "gemps.lock"
# What a file system that cannot lock files answers (some network file systems).
UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


class DirectoryInUse(OSError):
    """Another live process holds the directory's lock."""


class DirectoryLock:
    """`acquire()` before using the directory, `release()` when done (or let the process end)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Hold the directory (created if missing). Returns what the operator should hear of, if
        anything: a holder that died without releasing it (its lock, now recovered), or a file
        system that cannot lock (the directory is then used unguarded, as before). Raises
        DirectoryInUse when a live process holds it, OSError when the file cannot be opened."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise DirectoryInUse(
                f"{self.directory} is in use by another gemps server (pid {holder or 'unknown'}, lock {self.path}): "
                "give each server its own checkpoint directory"
            ) from None
        except OSError as error:
            os.close(fd)
            if error.errno not in UNSUPPORTED:
                raise
            return f"{self.path} cannot be locked here ({error.strerror}): nothing stops a second server using it"
        stale = _read_pid(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        if stale is not None and stale != os.getpid():
            return f"recovered the lock of pid {stale}, which is gone"
        return None

    def release(self) -> None:
        """Give the directory up (emptying the file: the next holder finds no stale pid)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
