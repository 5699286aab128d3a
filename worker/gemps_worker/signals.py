"""Stop long-running loops cleanly on SIGTERM/SIGINT, and the logging these commands use."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

log = logging.getLogger("gemps.worker")


def stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT set the returned event: the loop finishes its step, then leaves cleanly (a
    client given it ends a call its server leaves hanging 10 s after: gemps.stop_grace)."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: finishing the current step, then leaving", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
