"""The FIFO applier: operations run one at a time in submission order, and it keeps nothing of
an operation once its result is delivered (a commit's payload and reply are θ-sized)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable

from gemps_server.domain.applier import Applier


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
    try:
        gc.collect()
        # The thread is idle, waiting for the next operation: it holds neither.
        assert payload() is None
        assert reply() is None
    finally:
        applier.stop()
