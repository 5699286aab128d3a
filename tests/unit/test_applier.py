"""The FIFO applier: operations run one at a time in submission order, and it keeps nothing of
an operation once its result is delivered (a commit's payload and reply are θ-sized)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from gemps_server.domain.applier import Applier, ApplierStopped, Timed
from tests.helpers import wait_for

T = TypeVar("T")


def run_blocking(applier: Applier, operation: Callable[[], T], inline: bool = False) -> Timed[T]:
    """A thread that waits for its operation, through the data plane's door (submit_then)."""
    done = threading.Event()
    outcome: list[Any] = [None, None]

    def deliver(timed: Timed[T] | None, error: BaseException | None) -> None:
        outcome[:] = [timed, error]
        done.set()

    applier.submit_then(operation, deliver, inline)
    done.wait()
    if outcome[1] is not None:
        raise outcome[1]
    assert outcome[0] is not None
    return outcome[0]  # type: ignore[no-any-return]


class Payload:
    """Stands for a commit's θ-sized payload: only its lifetime matters."""


def test_operations_run_in_submission_order() -> None:
    async def run() -> list[int]:
        applier = Applier()
        applier.start()
        order: list[int] = []

        def record(i: int) -> Callable[[], None]:
            return lambda: order.append(i)

        try:
            await asyncio.gather(*(applier.submit(record(i)) for i in range(200)))
        finally:
            applier.stop()
        return order

    assert asyncio.run(run()) == list(range(200))


def test_nothing_of_an_operation_outlives_its_result() -> None:
    async def run() -> tuple[weakref.ref[Payload], weakref.ref[Payload], Applier]:
        applier = Applier()
        applier.start()
        payload, reply = Payload(), Payload()
        await applier.submit(lambda: (payload, reply)[1])  # the closure holds the payload; the result is the reply
        return weakref.ref(payload), weakref.ref(reply), applier

    payload, reply, applier = asyncio.run(run())

    def released() -> bool:
        gc.collect()
        return payload() is None and reply() is None

    try:
        # Once idle, waiting for the next operation, the thread holds neither. The result is delivered
        # before the thread lets go of the operation, so on a loaded host it is checked until then (a
        # fresh clone's make test read it in between); a thread that kept it would never let go.
        wait_for(released, 10, "the applier's thread letting go of the operation and its result")
    finally:
        applier.stop()


@dataclasses.dataclass
class Hammered:
    """What one round of submitters on threads and an event loop saw."""

    overlaps: list[str]  # operations that found another one running
    done: dict[str, list[int]]  # each submitter's operations, in the order they ran
    inline_threads: set[str]  # the threads that had an operation run inline (not queued)


def _hammered(seed: int, count: int = 200) -> Hammered:
    """Inline runs on 4 threads and on the event loop, and queued runs on the applier's thread, at once."""
    applier = Applier()
    applier.start()
    running = threading.Lock()  # taken without waiting: fails if another operation is running
    seen = Hammered([], {}, set())

    def operation(submitter: str, i: int) -> Callable[[], int]:
        def run() -> int:
            if not running.acquire(blocking=False):
                seen.overlaps.append(f"{submitter}:{i}")
                return i
            try:
                seen.done.setdefault(submitter, []).append(i)
                time.sleep(0.0002 if i % 2 == 0 else 0)  # long enough, now and then, to be caught
            finally:
                running.release()
            return i

        return run

    pauses = random.Random(seed)

    def hammer(name: str) -> None:
        for i in range(count):
            timed = run_blocking(applier, operation(name, i), inline=i % 3 != 0)
            assert timed.result == i
            if timed.timing.queued_seconds == 0.0:
                seen.inline_threads.add(name)
            time.sleep(pauses.random() * 0.0004)  # so that the applier is idle now and then: inline runs

    async def loop_side() -> None:
        for i in range(count):  # one at a time: its order is its submission order
            timed = await applier.submit_timed(operation("loop", i), inline=i % 2 == 0)
            assert timed.result == i
            await asyncio.sleep(pauses.random() * 0.0004)

    threads = [threading.Thread(target=hammer, args=(f"thread-{n}",)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        asyncio.run(loop_side())
        for thread in threads:
            thread.join(timeout=60)
    finally:
        applier.stop()
    return seen


def test_threads_and_an_event_loop_never_overlap_and_keep_each_submitters_order() -> None:
    """Never two operations at a time, and each submitter's in its order. The case in point is
    inline runs on several threads at once, which needs the applier idle now and then: a loaded
    host may keep it busy for a whole round, so up to three rounds are run until one has them."""
    for seed in (27, 28, 29):
        seen = _hammered(seed)
        assert not seen.overlaps
        assert set(seen.done) == {"loop", *(f"thread-{n}" for n in range(4))}
        assert all(order == list(range(200)) for order in seen.done.values())
        if len(seen.inline_threads) > 1:
            break
    assert len(seen.inline_threads) > 1, "no round had inline runs on more than one thread"


def test_run_blocking_raises_the_operations_error_and_refuses_after_stop() -> None:
    applier = Applier()
    applier.start()

    def fail() -> None:
        raise ValueError("refused")

    try:
        for inline in (True, False):
            try:
                run_blocking(applier, fail, inline=inline)
            except ValueError as error:
                assert str(error) == "refused"
            else:
                raise AssertionError("no error")
    finally:
        applier.stop()
    try:
        run_blocking(applier, lambda: None)
    except ApplierStopped:
        pass
    else:
        raise AssertionError("ran after stop")


def test_an_operations_cpu_time_leaves_out_what_it_waited() -> None:
    """gemps_applier_cpu_seconds: an operation that sleeps costs its thread no CPU, one that
    computes costs about its time; both queued and inline (on the caller's thread)."""

    def compute() -> None:
        until = time.thread_time() + 0.05
        while time.thread_time() < until:
            pass

    applier = Applier()
    applier.start()
    try:
        for inline in (False, True):
            slept = run_blocking(applier, lambda: time.sleep(0.2), inline).timing
            assert slept.run_seconds >= 0.2 and slept.cpu_seconds < 0.1, slept
            computed = run_blocking(applier, compute, inline).timing
            assert computed.cpu_seconds >= 0.05 and computed.cpu_seconds <= computed.run_seconds + 0.01, computed
    finally:
        applier.stop()
