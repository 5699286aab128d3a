"""The slow-backup rule (replication/lag.py) on the monitor's samples, with the clock given: which
acknowledgement patterns drop a backup and which do not."""

from __future__ import annotations

from collections.abc import Callable

from gemps_server.replication.lag import LagWindow

TIMEOUT = 2.0
TICK = 0.1  # the monitor's


def verdicts(age_at: Callable[[float], float], seconds: float, rate: float = 100.0) -> list[tuple[float, str]]:
    """Feed a LagWindow the oldest-unacknowledged age `age_at(t)` every tick for `seconds`; the
    times it said drop, and why."""
    window = LagWindow(TIMEOUT, now=0.0)
    said = []
    for step in range(1, int(seconds / TICK) + 1):
        now = step * TICK
        appended = int(now * rate)
        why = window.add(now, age_at(now), appended, appended - 1)
        if why:
            said.append((now, why))
    return said


def test_a_backup_acknowledging_every_0_9_timeouts_is_dropped_after_a_window() -> None:
    period = 0.9 * TIMEOUT
    said = verdicts(lambda t: t % period, 20.0, rate=1.0)
    assert said, "never dropped"
    when, why = said[0]
    assert when <= 2 * TIMEOUT + TICK  # once a whole window was seen
    assert "behind the primary's appends on average" in why and "0.25 x --replica-timeout" in why


def test_an_honest_backup_behind_by_tens_of_milliseconds_all_the_time_is_kept() -> None:
    # A loaded machine: always an entry waiting, each acknowledged 30-60 ms after it was appended.
    assert verdicts(lambda t: 0.03 + 0.03 * ((t * 7) % 1), 60.0) == []


def test_an_honest_backup_with_a_pause_inside_the_timeout_now_and_then_is_kept() -> None:
    # Fast, but for a 1.5 s stall (a collection, a checkpoint) every 10 s.
    assert verdicts(lambda t: (t % 10) if t % 10 < 1.5 else 0.01, 60.0) == []


def test_a_slow_backup_of_a_quiet_job_is_kept() -> None:
    # Each commit waits 0.9 timeouts, but commits come every 10 s: they wait less than half the time.
    assert verdicts(lambda t: (t % 10) if t % 10 < 0.9 * TIMEOUT else 0.0, 60.0) == []
