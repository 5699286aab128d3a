"""The one token bucket (token_bucket.py) behind every rate limit: registrations
(security.RateLimiter), the data plane's refusal budget (wire/refusal_budget.py) and TLS
handshake work per address (wire/tls_handshakes.py)."""

from __future__ import annotations

import threading

import pytest

from gemps_server.security import RateLimiter
from gemps_server.token_bucket import TokenBucket
from gemps_server.wire.refusal_budget import BURST_SECONDS, RefusalBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_allow_takes_a_cost_only_when_the_bucket_holds_it() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=3.0, clock=clock)
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]
    clock.now += 0.25  # half a token: still refused, and the refusal cost nothing
    assert not bucket.allow()
    clock.now += 0.25
    assert bucket.allow() and not bucket.allow()
    clock.now += 60.0  # never more than the burst
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]
    assert not TokenBucket(1.0, 1.0, clock).allow(1.5)  # a cost above what it holds


def test_charge_runs_into_debt_that_delay_waits_out() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=4.0, burst=2.0, clock=clock)
    assert bucket.delay() == 0.0 and bucket.full()
    for _ in range(5):
        bucket.charge()  # 2 - 5 = -3 tokens
    assert bucket.delay() == pytest.approx(1.0) and not bucket.full()  # 4 tokens to earn at 4 a second
    assert bucket.delay(0.5) == pytest.approx(0.875)
    clock.now += 1.0
    assert bucket.delay() == 0.0 and bucket.allow() and not bucket.allow()
    clock.now += 10.0
    assert bucket.full()


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_of_none_is_no_limit(rate: float) -> None:
    bucket = TokenBucket(rate, 0.0, Clock())
    bucket.charge(1e9)
    assert all(bucket.allow() for _ in range(1000)) and bucket.delay() == 0.0 and bucket.full()


def test_the_named_limits_are_buckets_of_their_settings() -> None:
    clock = Clock()
    registrations = RateLimiter(6, period=60.0, clock=clock)  # 6 at once, one every 10 s
    assert (registrations.rate, registrations.burst) == (0.1, 6)
    budget = RefusalBudget(50.0, clock=clock)
    assert (budget.rate, budget.burst) == (50.0, 50.0 * BURST_SECONDS)
    assert isinstance(registrations, TokenBucket) and isinstance(budget, TokenBucket)
    assert RefusalBudget(0.0).delay() == 0.0 and RateLimiter(0).allow()  # 0: no limit


def test_allow_is_thread_safe() -> None:
    bucket = TokenBucket(rate=1e-9, burst=1000.0, clock=Clock())  # as good as no refill
    allowed: list[int] = []
    barrier = threading.Barrier(8)

    def take() -> None:
        barrier.wait()
        allowed.append(sum(bucket.allow() for _ in range(500)))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(allowed) == 1000
