"""gemps.at_exit: who leaves at interpreter exit (issue 37, item 4). Against a real server and a
real exit: tests/integration/test_worker_presence.py."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from gemps import at_exit


class Worker:
    def __init__(self) -> None:
        self.left = 0

    def leave_at_exit(self) -> None:
        self.left += 1


@pytest.fixture(autouse=True)
def nobody_armed() -> Iterator[None]:
    """This test's workers only: what the rest of the process armed is put back after."""
    saved = dict(at_exit._registered)
    at_exit._registered.clear()
    yield
    at_exit._registered.clear()
    at_exit._registered.update(saved)


def test_armed_workers_leave_once_and_disarmed_ones_do_not() -> None:
    armed, disarmed = Worker(), Worker()
    at_exit.arm(armed)
    at_exit.arm(disarmed)
    at_exit.disarm(disarmed)
    at_exit.leave_all()
    at_exit.leave_all()
    assert (armed.left, disarmed.left) == (1, 0)


def test_a_dropped_worker_is_not_kept_alive() -> None:
    at_exit.arm(Worker())
    gc.collect()
    assert len(at_exit._registered) == 0


def test_a_forked_child_does_not_leave_for_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    parents = Worker()
    at_exit.arm(parents)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a child forked after arm()
    at_exit.leave_all()
    assert parents.left == 0
