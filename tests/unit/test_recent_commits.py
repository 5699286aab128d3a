"""The last minute's commits (domain/recent.py) that Status shows: rate, loss and staleness."""

from __future__ import annotations

import math

import pytest

from gemps_proto.status import RecentCommits
from gemps_server.domain.recent import BUCKET_SECONDS, RecentWindow
from gemps_server.domain.rules import ApplyStats

ONE = ApplyStats.constant(1.0)  # downpour's scaling


def test_a_window_counts_since_its_start_then_the_last_minute_only() -> None:
    window = RecentWindow(start=1000.0)
    assert window.summary(1000.0) == RecentCommits()
    window.add(1001.0, staleness=2, loss=3.0, num_samples=32, stats=ONE)
    window.add(1002.0, staleness=4, loss=None, num_samples=None, stats=ONE)  # reported neither
    window.add(1003.0, staleness=0, loss=math.nan, num_samples=32, stats=ONE)  # a NaN loss is not averaged
    early = window.summary(1010.0)
    assert early == RecentCommits(10.0, 3, 64, 1, 3.0, staleness=2.0, scaling_mean=1.0)
    assert early.rate == pytest.approx(0.3)
    window.add(1075.0, staleness=1, loss=1.0, num_samples=8, stats=ONE)
    late = window.summary(1080.0)  # the first three are more than a minute old
    assert late.commits == 1 and late.loss == 1.0 and late.samples == 8
    assert 55.0 <= late.seconds <= 60.0 and late.seconds == pytest.approx(1080.0 - (1080 // BUCKET_SECONDS - 11) * 5)
    assert window.summary(2000.0).commits == 0  # all gone


def test_a_busy_minute_is_a_dozen_buckets_whatever_the_rate() -> None:
    window = RecentWindow(start=0.0)
    for step in range(100_000):
        window.add(step * 0.001 + 100.0, staleness=1, loss=1.0, num_samples=1, stats=ONE)
    summary = window.summary(200.0)  # the buckets from 145 s on: 55 s of commits, one a millisecond
    assert (summary.seconds, summary.commits, summary.staleness, summary.loss) == (55.0, 55_000, 1.0, 1.0)
    assert len(window.rows) <= 12


def test_the_window_averages_how_the_rule_scaled_each_commit() -> None:
    """Issue 50, item 5: a worker's mean pi and its fractions at 0 and at pi_max over the minute,
    each commit's figure as its reply says it, averaged over the commits."""
    window = RecentWindow(start=0.0)
    damped = ApplyStats(scaling_mean=0.1, scaling_median=0.0, fraction_at_zero=0.9, fraction_at_max=0.0)
    boosted = ApplyStats(scaling_mean=2.5, scaling_median=5.0, fraction_at_zero=0.2, fraction_at_max=0.5)
    window.add(1.0, staleness=30, loss=None, num_samples=None, stats=damped)
    window.add(2.0, staleness=10, loss=None, num_samples=None, stats=boosted)
    summary = window.summary(4.0)
    assert (summary.scaling_mean, summary.scaling_at_zero, summary.scaling_at_max) == pytest.approx((1.3, 0.55, 0.25))
    assert summary.staleness == 20.0
    assert window.summary(100.0) == RecentCommits(seconds=55.0)  # none left: every figure 0
