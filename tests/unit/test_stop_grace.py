"""gemps.stop_grace: a call still in flight `grace` seconds after the stop is interrupted; none
before the stop, none while no call holds the client's lock, none after the client closed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gemps.stop_grace import StopGrace
from tests.helpers import wait_for

GRACE = 0.2


def counter() -> tuple[list[float], Callable[[], None]]:
    """The times `interrupt` was called, and the callable that records them."""
    times: list[float] = []
    return times, lambda: times.append(time.monotonic())


def test_a_call_in_flight_after_the_grace_is_interrupted_and_again_while_it_lasts() -> None:
    stop, calls, (interrupts, interrupt) = threading.Event(), threading.RLock(), counter()
    grace = StopGrace(stop, interrupt, calls, grace=GRACE)
    with calls:  # a call in flight, held by this thread
        time.sleep(3 * GRACE)
        assert len(interrupts) == 0  # no stop yet
        stopped = time.monotonic()
        stop.set()
        wait_for(lambda: len(interrupts) >= 2, timeout=10.0)  # the first after the grace, then each grace
    grace.close()
    assert interrupts[0] - stopped >= 0.9 * GRACE and interrupts[1] - interrupts[0] >= 0.9 * GRACE, interrupts


def test_no_call_in_flight_nothing_is_interrupted() -> None:
    stop, calls, (interrupts, interrupt) = threading.Event(), threading.RLock(), counter()
    grace = StopGrace(stop, interrupt, calls, grace=GRACE)
    stop.set()
    time.sleep(5 * GRACE)
    assert len(interrupts) == 0
    assert calls.acquire(blocking=False)  # the look at the lock gave it back
    calls.release()
    grace.close()


def test_a_closed_client_stops_watching_and_no_stop_starts_no_thread() -> None:
    assert StopGrace(None, counter()[1], threading.RLock()).thread is None
    stop, calls, (interrupts, interrupt) = threading.Event(), threading.RLock(), counter()
    grace = StopGrace(stop, interrupt, calls, grace=GRACE)
    assert grace.thread is not None and grace.thread.is_alive()
    grace.close()
    grace.thread.join(timeout=10.0)  # ends within its look (0.5 s)
    assert not grace.thread.is_alive()
    with calls:
        stop.set()
        time.sleep(3 * GRACE)
    assert len(interrupts) == 0
