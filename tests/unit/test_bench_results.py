"""The benchmark's fairness figures: Jain's index, its ceiling for whole counts, and progress
counted by each round trip's share of the window; the counts its command line reads."""

from __future__ import annotations

import math

import pytest
from gemps_bench.counts import parse_counts
from gemps_bench.results import LoadResult, jain_index, share_in_window, whole_count_ceiling


def test_jain_index_spans_one_to_one_over_n() -> None:
    assert jain_index([5, 5, 5, 5]) == 1.0
    assert jain_index([8, 0, 0, 0]) == pytest.approx(0.25)
    assert math.isnan(jain_index([]))


def test_whole_counts_cap_jain_below_one_when_clients_get_a_few_commits_each() -> None:
    # The 2026-11-21 bench at 1M and 100 clients: 237 commits in the window, Jain 0.960 reported.
    assert whole_count_ceiling(237, 100) == pytest.approx(0.960, abs=5e-4)
    assert whole_count_ceiling(800, 100) == 1.0  # a whole number of rounds
    assert whole_count_ceiling(100_050, 100) > 0.9999  # many rounds: negligible


def test_a_round_trip_counts_by_its_share_of_the_window() -> None:
    assert share_in_window(1.0, 2.0, 0.0, 10.0) == 1.0
    assert share_in_window(-1.0, 1.0, 0.0, 10.0) == 0.5  # straddles the start
    assert share_in_window(9.0, 13.0, 0.0, 10.0) == 0.25  # straddles the end
    assert share_in_window(11.0, 12.0, 0.0, 10.0) == 0.0


def test_round_robin_service_is_perfectly_fair_by_progress_not_by_whole_counts() -> None:
    """Three clients served in turn, 1 s each, over a 10 s window: whole counts differ (4, 3, 3)
    although the server is exactly fair; counted by progress they are equal."""
    clients, window = 3, (0.0, 10.0)
    trips = {c: [(start, start + 1.0) for start in range(c, 30, clients)] for c in range(clients)}
    # A closed loop: each client's round trip lasts from its previous reply to its next (3 s).
    closed = {c: [(done - 3.0, done) for _, done in trips[c]] for c in range(clients)}
    counts = [sum(window[0] <= done <= window[1] for _, done in closed[c]) for c in range(clients)]
    progress = [sum(share_in_window(b, d, *window) for b, d in closed[c]) for c in range(clients)]
    assert sorted(counts) == [3, 3, 4] and jain_index(counts) < 0.99
    result = LoadResult("x", 1, clients, 10.0, [], counts, per_client_progress=progress)
    assert result.fairness == pytest.approx(1.0)
    assert result.summary()["jain_index_whole_commits"] == jain_index(counts)


def test_bench_counts_read_units_and_refuse_what_is_not_a_count() -> None:
    assert parse_counts("100K, 1M,2.5M,8") == [100_000, 1_000_000, 2_500_000, 8]
    for bad in ("", "0", "1M,ten", "-5"):
        with pytest.raises(ValueError):
            parse_counts(bad)
