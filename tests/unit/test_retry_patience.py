"""A call retries a server that does not answer for the client's patience (issue 43, item 6), not
for a fixed 15 attempts (about 45 s, said nowhere), and says which option to raise when it gives up."""

from __future__ import annotations

import grpc
import pytest

import gemps
from gemps import errors
from gemps.retry import DEFAULT_PATIENCE, Retrier, RetryPolicy, resolve_patience
from tests.unit.test_retry_failover import attempts_failing_with, refusals

QUICK = RetryPolicy(initial_backoff=0.001, max_backoff=0.001)  # the default's count: none


def test_retries_go_on_past_fifteen_attempts_within_the_patience() -> None:
    calls, attempt = attempts_failing_with(refusals(40, ""))
    assert Retrier("down", QUICK, patience=30.0).call(attempt) == "answered"
    assert len(calls) == 41


def test_running_out_of_patience_names_the_option() -> None:
    _calls, attempt = attempts_failing_with(refusals(10**6, ""))
    with pytest.raises(errors.ServerUnavailableError) as raised:
        Retrier("127.0.0.1:1", RetryPolicy(initial_backoff=0.01, max_backoff=0.05), patience=0.3).call(attempt)
    message = str(raised.value)
    assert "127.0.0.1:1 did not answer for" in message and "patience being 0.3 s" in message
    assert "Client(patience=...)" in message and "GEMPS_PATIENCE" in message and "--patience" in message
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE


def test_an_explicit_attempt_cap_still_applies() -> None:
    calls, attempt = attempts_failing_with(refusals(10, ""))
    with pytest.raises(errors.ServerUnavailableError, match="unreachable after 3 attempts"):
        Retrier("down", RetryPolicy(max_attempts=3, initial_backoff=0.001), patience=30.0).call(attempt)
    assert len(calls) == 3


def test_patience_from_the_argument_the_variable_or_the_default() -> None:
    assert resolve_patience(None, {}) == DEFAULT_PATIENCE >= 180  # a server's restart, with room
    assert resolve_patience(None, {"GEMPS_PATIENCE": "12.5"}) == 12.5
    assert resolve_patience(7.0, {"GEMPS_PATIENCE": "12.5"}) == 7.0
    with pytest.raises(ValueError, match="GEMPS_PATIENCE='soon' is not a number of seconds"):
        resolve_patience(None, {"GEMPS_PATIENCE": "soon"})
    with pytest.raises(ValueError, match="patience must be a number of seconds > 0, not 0"):
        resolve_patience(0.0, {})


def test_the_client_default_timeout_outlasts_its_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEMPS_PATIENCE", raising=False)
    client = gemps.Client("127.0.0.1:1")
    assert (client.patience, client.timeout, client.attempt_timeout) == (DEFAULT_PATIENCE, DEFAULT_PATIENCE + 60, 60)
    short = gemps.Client("127.0.0.1:1", patience=5, timeout=10)
    assert (short.patience, short.timeout, short.attempt_timeout) == (5, 10, 10)
    client.close()
    short.close()


def test_a_call_ended_cancelled_by_what_sat_across_it_is_made_again() -> None:
    """The client ends none of its calls CANCELLED (the primary watch says so in its own words), so
    one that ends so was ended by a server on its way out or a proxy: retried, not raised (a Ray
    worker's registration failed a job so once, as its partition's node was lost)."""
    cancelled = errors.from_status(grpc.StatusCode.CANCELLED, "CANCELLED")
    assert isinstance(cancelled, errors.CallCancelledError) and cancelled.code == grpc.StatusCode.CANCELLED
    calls, attempt = attempts_failing_with([cancelled, errors.from_status_number(1, "CANCELLED")])
    assert Retrier("leaving", QUICK, patience=30.0).call(attempt) == "answered"
    assert len(calls) == 3
