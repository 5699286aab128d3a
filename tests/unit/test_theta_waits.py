"""Pulls held until θ moves (gemps_server.theta_waits): each woken exactly once, a move between a
wait's adding and its check never missed, at most `limit` held, none once the server stops."""

from __future__ import annotations

from gemps_server.theta_waits import ThetaWaits


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def wake(self) -> None:
        self.count += 1


def test_a_held_wait_is_woken_once_by_the_next_move_and_forgotten_after() -> None:
    waits, wakes = ThetaWaits(limit=4), Wakes()
    forget = waits.hold(lambda: True, wakes.wake)
    assert forget is not None and len(waits) == 1
    waits.moved()
    waits.moved()
    assert wakes.count == 1 and len(waits) == 0
    assert forget() is False  # woken already: the caller's timer does nothing more


def test_a_wait_whose_theta_moved_already_is_not_held() -> None:
    waits, wakes = ThetaWaits(limit=4), Wakes()
    assert waits.hold(lambda: False, wakes.wake) is None
    assert len(waits) == 0 and wakes.count == 0


def test_a_move_between_the_adding_and_the_check_wakes_the_wait() -> None:
    """The commit that moves θ is counted after the wait was added and before its check: the
    check then finds θ moved, but the wake already went out, so the caller waits for it (it comes
    at once) rather than answering a second time."""
    waits, wakes = ThetaWaits(limit=4), Wakes()

    def moved_meanwhile() -> bool:
        waits.moved()
        return False

    forget = waits.hold(moved_meanwhile, wakes.wake)
    assert forget is not None and wakes.count == 1 and forget() is False


def test_past_the_limit_a_pull_is_answered_at_once() -> None:
    waits = ThetaWaits(limit=2)
    held = [waits.hold(lambda: True, Wakes().wake) for _ in range(3)]
    assert held[0] is not None and held[1] is not None and held[2] is None and len(waits) == 2
    assert held[0]() is True and waits.hold(lambda: True, Wakes().wake) is not None  # room again


def test_a_stopping_server_wakes_every_wait_and_holds_none_after() -> None:
    waits, wakes = ThetaWaits(limit=4), Wakes()
    waits.hold(lambda: True, wakes.wake)
    waits.hold(lambda: True, wakes.wake)
    waits.stop()
    assert wakes.count == 2 and waits.hold(lambda: True, wakes.wake) is None


def test_a_round_that_wants_some_workers_next_commits_wakes_their_waits_alone() -> None:
    """θ unmoved, the round wanting a's and c's next commits: their waits are woken, b's stays
    held until θ moves (woken, it would answer unchanged and its client poll)."""
    waits = ThetaWaits(limit=4)
    wakes = {name: Wakes() for name in "abc"}
    for name, wake in wakes.items():
        assert waits.hold(lambda: True, wake.wake, name) is not None
    waits.moved(frozenset({"a", "c"}))
    assert [wakes[name].count for name in "abc"] == [1, 0, 1] and len(waits) == 1
    waits.moved()
    assert [wakes[name].count for name in "abc"] == [1, 1, 1] and len(waits) == 0
