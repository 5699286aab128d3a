"""A partition's tie to its supervisor: it dies with it.

`gemps server --partitions K` runs each partition as a child process. Nothing tied a child to its
parent: SIGKILL the supervisor and the partitions lived on, holding their ports, and a new
supervisor started beside them shared every port with the orphans (issue 28, item 1). Now the
supervisor gives each child its pid (`--supervisor-pid`), and the child

1. asks the kernel for SIGTERM when its parent dies (Linux's PR_SET_PDEATHSIG): the same graceful
   shutdown as an operator's SIGTERM, final checkpoint included;
2. checks right after that its parent is still the supervisor, since it may have died before
   the request was made (the child then was given to another parent and no signal will come);
3. keeps checking every CHECK_SECONDS while it serves, for systems without the signal.

The kernel sends the signal when the *thread* that started the child ends, so the supervisor
starts and restarts partitions from its main thread only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

# How often a partition checks that its supervisor is still its parent.
CHECK_SECONDS = 1.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent exits; False where the
    kernel cannot (not Linux), which leaves the periodic check."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        prctl = ctypes.CDLL(name, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return bool(prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)


def parent_is(pid: int) -> bool:
    """Whether `pid` is still this process's parent (a dead parent's children are re-parented)."""
    return os.getppid() == pid
