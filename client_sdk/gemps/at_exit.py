"""Leave at interpreter exit: a registered client the program did not close leaves its servers.

Otherwise a worker whose script ends without `close()` (PyTorch's examples never call it) counts
as active on the server until its lease expires. Only weak references are held, so a client that
is dropped is not kept alive; `close()` takes the client off; exit waits at most
EXIT_DEADLINE_SECONDS in all, so an unreachable server never holds it up (each client leaves on a
daemon thread, abandoned at the deadline). A forked child that exits through sys.exit does not
leave for its parent: each client leaves only from the process that registered it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from typing import Protocol

# How long exit may wait, in all, for the clients to leave.
EXIT_DEADLINE_SECONDS = 2.0


class Leaving(Protocol):
    def leave_at_exit(self) -> None: ...


# Each client still registered, and the process that registered it.
_registered: weakref.WeakKeyDictionary[Leaving, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_hooked = False


def arm(client: Leaving) -> None:
    """Have `client` leave at exit unless `disarm`ed before."""
    global _hooked
    with _lock:
        _registered[client] = os.getpid()
        if not _hooked:
            atexit.register(leave_all)
            _hooked = True


def disarm(client: Leaving) -> None:
    with _lock:
        _registered.pop(client, None)


def leave_all(deadline: float = EXIT_DEADLINE_SECONDS) -> None:
    """Every armed client of this process leaves, concurrently, for at most `deadline` seconds."""
    with _lock:
        clients = [client for client, pid in list(_registered.items()) if pid == os.getpid()]
        _registered.clear()
    threads = [threading.Thread(target=client.leave_at_exit, name="gemps-leave", daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
