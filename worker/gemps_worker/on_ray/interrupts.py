"""Stopping a Ray job to its end under repeated interrupts (Ctrl-C, Ray's cancel of the task)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("gemps.ray")


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """While stopping, a further Ctrl-C is noted, not raised, so the stop runs to its end. Ray's
    cancel of a running task is such an interrupt, repeated until the task ends (every couple of
    seconds): without this, a stop taking longer was cut short. Main thread only (signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: object) -> None:
        log.warning("interrupted again: still stopping the job")

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
