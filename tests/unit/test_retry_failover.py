"""Retries of refusals by replicas that are not primary (a failover under way): quick, not
growing, and not spending the retry budget meant for a server that is down."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from gemps import errors
from gemps.retry import FAILOVER_RETRY_SECONDS, Retrier, RetryPolicy
from gemps_proto.reasons import Reason


def refusals(count: int, reason: str) -> list[errors.GempsError]:
    return [errors.ServerUnavailableError("UNAVAILABLE: not now", grpc.StatusCode.UNAVAILABLE, reason)] * count


def attempts_failing_with(failures: list[errors.GempsError]) -> tuple[list[float], Callable[[], str]]:
    """An attempt that raises `failures` in turn, then answers; the times it was called."""
    calls: list[float] = []

    def attempt() -> str:
        calls.append(time.monotonic())
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return "answered"

    return calls, attempt


def test_not_primary_refusals_are_retried_quickly_past_the_attempt_budget() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=5.0, max_backoff=5.0)  # 5 s waits: the test would notice
    calls, attempt = attempts_failing_with(refusals(8, Reason.NOT_PRIMARY))
    started = time.monotonic()
    assert Retrier("replicas", policy).call(attempt) == "answered"
    assert len(calls) == 9  # past max_attempts: failover retries do not spend it
    assert time.monotonic() - started < 9 * FAILOVER_RETRY_SECONDS + 1.0


def test_other_unavailable_refusals_still_spend_the_budget() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.01)
    calls, attempt = attempts_failing_with(refusals(8, ""))
    with pytest.raises(errors.ServerUnavailableError, match="unreachable after 3 attempts"):
        Retrier("down", policy).call(attempt)
    assert len(calls) == 3
