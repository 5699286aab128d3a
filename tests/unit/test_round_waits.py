"""The SDK's wait for a round (gemps.rounds): θ handed back once it moved, pulls spaced out, and a
round that cannot close (its workers gone) given up after a bound the client learns."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gemps.records import CentralVariable, CommitResult
from gemps.rounds import IDLE_SECONDS, LONGEST_PAUSE, ROUND_WAIT_SECONDS, SLOWEST_PAUSE, RoundWaits


def central(version: int) -> CentralVariable:
    return CentralVariable(version, np.full(3, float(version), np.float32), ())


def committed(version: int, pending: int) -> CommitResult:
    return CommitResult(version, 0, 0.25, central(version), round_pending=pending)


class Clock:
    """A clock that moves only when the wait sleeps; pulls see θ move at `moves_at` seconds."""

    def __init__(self, moves_at: float | None) -> None:
        self.now, self.moves_at = 0.0, moves_at
        self.pauses: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    def pull(self, wait: float = 0.0) -> CentralVariable:
        """A server that holds no pull (older than PullRequest.wait_seconds): answered at once."""
        return central(9 if self.moves_at is not None and self.now >= self.moves_at else 5)


class HoldingServer(Clock):
    """A server that holds a pull until θ moves (at `moves_at`) or its wait passes."""

    def __init__(self, moves_at: float | None) -> None:
        super().__init__(moves_at)
        self.waits: list[float] = []

    def pull(self, wait: float = 0.0) -> CentralVariable:
        self.waits.append(wait)
        until = self.now + wait if self.moves_at is None else min(self.now + wait, max(self.now, self.moves_at))
        self.now = until
        return super().pull()


def waits(clock: Clock) -> RoundWaits:
    return RoundWaits(clock=lambda: clock.now, sleep=clock.sleep)


def test_a_commit_that_moved_theta_or_joined_no_round_is_handed_back_as_it_came() -> None:
    clock = Clock(moves_at=0.0)
    result = committed(5, pending=0)
    assert waits(clock).after(result, clock.pull) is result and clock.pauses == []


def test_theta_is_handed_back_once_it_moved_the_pulls_spaced_out_to_20_ms() -> None:
    clock = Clock(moves_at=0.5)
    rounds = waits(clock)
    result = rounds.after(committed(5, pending=3), clock.pull)
    assert result.parameters.version == 9 and result.version == 5  # the commit's own figures kept
    assert clock.pauses[:3] == [0.001, 0.002, 0.004] and max(clock.pauses) == LONGEST_PAUSE
    assert rounds.longest == pytest.approx(clock.now) and 0.5 <= clock.now < 0.5 + LONGEST_PAUSE


def test_the_pulls_slow_down_to_an_eighth_of_the_recent_waits_so_a_server_is_not_kept_busy() -> None:
    rounds = waits(clock := Clock(moves_at=3.0))
    rounds.after(committed(5, pending=3), clock.pull)
    slowest = rounds.longest_pause()
    assert rounds.recent == pytest.approx(clock.now) and slowest == pytest.approx(clock.now / 8)
    again = Clock(moves_at=3.0)
    rounds.clock, rounds.sleep = (lambda: again.now), again.sleep
    rounds.after(committed(5, pending=3), again.pull)
    assert max(again.pauses) == slowest and len(again.pauses) < 20  # not 150 pulls of 20 ms
    assert RoundWaits().longest_pause() == LONGEST_PAUSE and SLOWEST_PAUSE == 0.5


def test_a_round_that_does_not_close_is_given_up_at_four_times_the_longest_seen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds = waits(clock := Clock(moves_at=0.1))
    rounds.after(committed(5, pending=1), clock.pull)
    assert rounds.limit() == IDLE_SECONDS  # four times 0.1 s, at least a second
    rounds.longest = 2.0
    stuck = Clock(moves_at=None)  # the workers it waits for are gone
    rounds.clock, rounds.sleep = (lambda: stuck.now), stuck.sleep
    with caplog.at_level(logging.WARNING, logger="gemps.rounds"):
        result = rounds.after(held := committed(5, pending=2), stuck.pull)
    assert result is held and 8.0 <= stuck.now < 8.0 + LONGEST_PAUSE
    assert "its round needed 2 more" in caplog.text and "joins that round" in caplog.text
    assert waits(Clock(None)).limit() == ROUND_WAIT_SECONDS  # before any round: the longest wait


def test_a_server_that_holds_pulls_answers_the_wait_in_one_pull_with_no_sleep() -> None:
    """Each pull asks the server to hold it (at most `hold`): θ moving at 0.5 s is handed back at
    0.5 s, from one pull and no pause, where polling took tens of pulls."""
    server = HoldingServer(moves_at=0.5)
    rounds = RoundWaits(clock=lambda: server.now, sleep=server.sleep, hold=2.0)
    result = rounds.after(committed(5, pending=3), server.pull)
    assert result.parameters.version == 9 and server.now == pytest.approx(0.5)
    assert server.waits == [2.0] and server.pauses == []


def test_a_held_wait_asks_no_further_than_the_round_s_limit(caplog: pytest.LogCaptureFixture) -> None:
    """A round that does not close: holds of `hold` seconds up to the limit, the last one shorter,
    then the warning; no poll in between."""
    server = HoldingServer(moves_at=None)
    rounds = RoundWaits(clock=lambda: server.now, sleep=server.sleep, hold=3.0)
    rounds.longest = 2.0  # the limit: 8 s
    with caplog.at_level(logging.WARNING, logger="gemps.rounds"):
        result = rounds.after(held := committed(5, pending=2), server.pull)
    assert result is held and server.now == pytest.approx(8.0)
    assert server.waits == pytest.approx([3.0, 3.0, 2.0]) and server.pauses == []


class DepartingServer(Clock):
    """A server whose θ never moves: the worker its round waits for leaves at `left_at`, and a
    held pull is answered then, the round closable from then on."""

    def __init__(self, left_at: float) -> None:
        super().__init__(moves_at=None)
        self.left_at = left_at

    def pull(self, wait: float = 0.0) -> CentralVariable:
        self.now = min(self.now + wait, max(self.now, self.left_at))
        return super().pull()

    def takes_next(self) -> bool:
        return self.now >= self.left_at


def test_a_round_that_takes_the_waiting_workers_next_gradient_ends_the_wait_when_the_server_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker the round waited for leaves at 0.3 s, the others waiting: the server answers the
    held pull then, saying the round takes their next commits. The commit is handed back at once,
    θ as it is, with no warning, where it waited out the limit (60 s in a first round)."""
    server = DepartingServer(left_at=0.3)
    rounds = RoundWaits(clock=lambda: server.now, sleep=server.sleep, hold=2.0)
    with caplog.at_level(logging.DEBUG, logger="gemps.rounds"):
        result = rounds.after(held := committed(5, pending=2), server.pull, server.takes_next)
    assert result is held and server.now == pytest.approx(0.3) and server.pauses == []
    assert [record.levelno for record in caplog.records] == [logging.DEBUG]  # no warning
    assert "takes this worker's next gradient" in caplog.text and rounds.longest is None  # no round closed
