"""The last minute's commits (domain/recent.py) that Status shows: rate, loss and staleness."""

from __future__ import annotations

import math

import pytest

from gemps_proto.status import RecentCommits
from gemps_server.domain.recent import BUCKET_SECONDS, RecentWindow


def test_a_window_counts_since_its_start_then_the_last_minute_only() -> None:
    window = RecentWindow(start=1000.0)
    assert window.summary(1000.0) == RecentCommits()
    window.add(1001.0, staleness=2, loss=3.0, num_samples=32)
    window.add(1002.0, staleness=4, loss=None, num_samples=None)  # reported neither
    window.add(1003.0, staleness=0, loss=math.nan, num_samples=32)  # a NaN loss is not averaged
    early = window.summary(1010.0)
    assert early == RecentCommits(seconds=10.0, commits=3, samples=64, loss_commits=1, loss=3.0, staleness=2.0)
    assert early.rate == pytest.approx(0.3)
    window.add(1075.0, staleness=1, loss=1.0, num_samples=8)
    late = window.summary(1080.0)  # the first three are more than a minute old
    assert late.commits == 1 and late.loss == 1.0 and late.samples == 8
    assert 55.0 <= late.seconds <= 60.0 and late.seconds == pytest.approx(1080.0 - (1080 // BUCKET_SECONDS - 11) * 5)
    assert window.summary(2000.0).commits == 0  # all gone


def test_a_busy_minute_is_a_dozen_buckets_whatever_the_rate() -> None:
    window = RecentWindow(start=0.0)
    for step in range(100_000):
        window.add(step * 0.001 + 100.0, staleness=1, loss=1.0, num_samples=1)
    summary = window.summary(200.0)  # the buckets from 145 s on: 55 s of commits, one a millisecond
    assert (summary.seconds, summary.commits, summary.staleness, summary.loss) == (55.0, 55_000, 1.0, 1.0)
    assert len(window._buckets) <= 12
