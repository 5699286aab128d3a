"""The lifecycle stack (gemps_server/lifecycle.py), without a server: the order parts start and
stop in, what a failed start unwinds, and a stop that goes on past a failing part."""

from __future__ import annotations

import asyncio

import pytest

from gemps_server.lifecycle import Stack, Step, Together


class Recorded:
    """A part that writes what happens to it into `log` (and fails to start when told to)."""

    def __init__(self, name: str, log: list[str], fail_start: bool = False, fail_stop: bool = False) -> None:
        self.name, self._log = name, log
        self._fail_start, self._fail_stop = fail_start, fail_stop

    async def start(self) -> None:
        if self._fail_start:
            raise OSError(f"{self.name}: cannot listen")
        self._log.append(f"start {self.name}")

    async def stop(self, grace: float) -> None:
        self._log.append(f"stop {self.name} {grace:g}")
        if self._fail_stop:
            raise RuntimeError(f"{self.name} would not stop")


def test_parts_stop_in_reverse_with_the_grace() -> None:
    log: list[str] = []
    stack = Stack([Recorded("a", log), None, Recorded("b", log)])  # None: a part this server lacks
    asyncio.run(stack.start())
    asyncio.run(stack.stop(2.0))
    assert log == ["start a", "start b", "stop b 2", "stop a 2"]
    asyncio.run(stack.stop(2.0))  # stopped once
    assert len(log) == 4


def test_a_failed_start_unwinds_exactly_what_started_without_grace() -> None:
    log: list[str] = []
    stack = Stack([Recorded("a", log), Recorded("b", log), Recorded("c", log, fail_start=True), Recorded("d", log)])
    with pytest.raises(OSError, match="c: cannot listen"):
        asyncio.run(stack.start())
    assert log == ["start a", "start b", "stop b 0", "stop a 0"]


def test_a_part_that_fails_to_stop_does_not_keep_the_others() -> None:
    log: list[str] = []
    stack = Stack([Recorded("a", log), Recorded("b", log, fail_stop=True), Recorded("c", log)])
    asyncio.run(stack.start())
    with pytest.raises(RuntimeError, match="b would not stop"):
        asyncio.run(stack.stop(1.0))
    assert log[3:] == ["stop c 1", "stop b 1", "stop a 1"]


def test_parts_together_stop_at_once() -> None:
    """Both doors get the grace at the same time: the second does not wait for the first's."""
    stopping: list[str] = []
    both = asyncio.Event()

    async def door(name: str, grace: float) -> None:
        stopping.append(name)
        if len(stopping) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 5)

    async def run() -> None:
        together = Together(
            "doors", [Step("data", end=lambda g: door("data", g)), Step("grpc", end=lambda g: door("grpc", g))]
        )
        await together.start()
        await together.stop(1.0)

    asyncio.run(run())
    assert sorted(stopping) == ["data", "grpc"]
