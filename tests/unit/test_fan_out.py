"""gemps.fan_out: where each partition's call runs, what it sees, and what comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from gemps import errors
from gemps.fan_out import THREADED_BYTES, FanOut
from gemps.transport import Deadline, Failed, call_deadline, current_deadline


class Done:
    """A call whose reply is in hand: `result()` runs `read` on whichever thread waits for it."""

    def __init__(self, read: Callable[[], str]) -> None:
        self._read = read

    def result(self) -> str:
        return self._read()


def where(seen: dict[int, tuple[str, Deadline | None]]) -> Callable[[int], Done]:
    """A start that records, for each server, the thread its exchange ran on and the deadline it saw."""

    def start(index: int) -> Done:
        def read() -> str:
            seen[index] = (threading.current_thread().name, current_deadline())
            return f"reply {index}"

        return Done(read)

    return start


def never(index: int) -> str:
    raise AssertionError(f"server {index} retried")


def test_a_large_call_runs_each_other_partition_on_a_thread_of_its_own_within_the_callers_deadline() -> None:
    seen: dict[int, tuple[str, Deadline | None]] = {}
    fan = FanOut()
    try:
        with call_deadline(30) as deadline:
            replies = fan.calls(4, where(seen), never, lambda i, e: None, nbytes=THREADED_BYTES)
    finally:
        fan.close()
    assert replies == ["reply 0", "reply 1", "reply 2", "reply 3"]
    assert seen[0] == (threading.current_thread().name, deadline)
    assert {seen[i] for i in (1, 2, 3)} == {("gemps-partition-call", deadline)}


def test_a_small_call_stays_on_the_callers_thread() -> None:
    seen: dict[int, tuple[str, Deadline | None]] = {}
    fan = FanOut()
    assert fan.calls(3, where(seen), never, lambda i, e: None, nbytes=THREADED_BYTES - 1) == [
        "reply 0",
        "reply 1",
        "reply 2",
    ]
    assert {name for name, _ in seen.values()} == {threading.current_thread().name}


@pytest.mark.parametrize("nbytes", [0, THREADED_BYTES])
def test_a_failure_worth_another_attempt_is_retried_and_another_takes_its_calls_place(nbytes: int) -> None:
    unavailable = errors.ServerUnavailableError("UNAVAILABLE: down", errors.ServerUnavailableError.code)
    refused = errors.InvalidArgumentError("bad", errors.InvalidArgumentError.code)
    outcomes: dict[int, errors.GempsError | str] = {0: "reply 0", 1: unavailable, 2: refused}

    def start(index: int) -> Failed[str] | Done:
        outcome = outcomes[index]
        return Failed(outcome) if isinstance(outcome, errors.GempsError) else Done(lambda: str(outcome))

    suspected: list[tuple[int, errors.GempsError]] = []
    fan = FanOut()
    try:
        replies = fan.calls(
            3, start, lambda index: f"retried {index}", lambda i, e: suspected.append((i, e)), nbytes=nbytes
        )
    finally:
        fan.close()
    assert replies == ["reply 0", "retried 1", refused]
    assert suspected == [(1, unavailable)]


def test_a_bug_in_a_partitions_call_reaches_the_caller() -> None:
    def start(index: int) -> Done:
        if index == 1:
            raise RuntimeError("a bug")
        return Done(lambda: "reply")

    fan = FanOut()
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            fan.calls(2, start, never, lambda i, e: None, nbytes=THREADED_BYTES)
    finally:
        fan.close()


@pytest.mark.parametrize("nbytes", [THREADED_BYTES - 1, THREADED_BYTES])
def test_each_servers_work_ends_before_each_returns_and_its_failure_is_its_own(nbytes: int) -> None:
    ran: dict[int, str] = {}

    def work(index: int) -> int:
        time.sleep(0.05 * (3 - index))  # the later servers' work ends first
        ran[index] = threading.current_thread().name
        if index == 1:
            raise ValueError("server 1's slice")
        return index * 10

    fan = FanOut()
    try:
        done = fan.each(3, work, nbytes=nbytes)
    finally:
        fan.close()
    assert sorted(ran) == [0, 1, 2]  # every server's work had ended: none is left running
    assert done[0].result() == 0 and done[2].result() == 20
    with pytest.raises(ValueError, match="server 1's slice"):
        done[1].result()
    caller = threading.current_thread().name
    if nbytes >= THREADED_BYTES:  # server 0's on the caller's thread, each other's on one of ours
        assert ran == {0: caller, 1: "gemps-partition-call", 2: "gemps-partition-call"}
    else:
        assert set(ran.values()) == {caller}
