"""A stop that also ends a call in flight, once its grace is over.

A client given `stop` (a worker's SIGTERM or Ctrl-C handler sets it) ends a wait to retry at once
(gemps.retry), and the worker finishes its step and leaves. But a call blocked on a server that
neither answers nor closes its connections (a SIGSTOPped process, a frozen VM) waited for its
attempt's timeout, 60 s by default: a worker told to stop took a minute to. Once `stop` has been
set for STOP_GRACE_SECONDS (a commit takes milliseconds, a large one over a slow link seconds) a
call still in flight is interrupted: it fails as unavailable, and its retry, seeing the stop,
raises StoppedError.

One daemon thread per client given a stop, which looks at the event twice a second until the
client closes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("gemps.client")

#: how long a call may go on after the stop before it is interrupted, seconds
STOP_GRACE_SECONDS = 10.0
_LOOK_SECONDS = 0.5


class Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


class StopGrace:
    """Calls `interrupt` (end every call in flight) `grace` seconds after `stop` is set, and every
    `grace` seconds after, while a call holds `calls` (the client's lock) and until closed. No
    `stop`, nothing to watch: no thread."""

    def __init__(
        self,
        stop: threading.Event | None,
        interrupt: Callable[[], None],
        calls: Lock,
        grace: float = STOP_GRACE_SECONDS,
    ) -> None:
        self.grace = grace
        self._interrupt, self._calls = interrupt, calls
        self._closed = threading.Event()
        self.thread: threading.Thread | None = None
        if stop is not None:
            self.thread = threading.Thread(target=self._run, args=(stop,), name="gemps-stop-grace", daemon=True)
            self.thread.start()

    def close(self) -> None:
        self._closed.set()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(_LOOK_SECONDS):
            if self._closed.is_set():
                return
        while not self._closed.wait(self.grace):
            if self._busy():
                log.warning(
                    "gemps: a call still waits on its server %g s after the stop: ending the call in flight",
                    self.grace,
                )
                self._interrupt()

    def _busy(self) -> bool:
        """Whether a call holds the client's lock (taken and given back at once when free)."""
        if self._calls.acquire(blocking=False):
            self._calls.release()
            return False
        return True
