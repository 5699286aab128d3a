"""The reply budget (server/gemps_server/wire/reply_budget.py) as both planes use it: the data
plane's loop with grants, gRPC's asyncio with awaits, in arrival order, nothing leaked."""

from __future__ import annotations

import asyncio

import pytest

from gemps_server.wire.reply_budget import Grant, ReplyBudget


def test_waiters_are_granted_in_arrival_order_and_a_withdrawn_one_lets_the_next_in() -> None:
    budget = ReplyBudget(10)
    granted: list[str] = []

    def grant(name: str) -> Grant:
        def granted_to() -> bool:
            granted.append(name)
            return True

        return granted_to

    assert budget.try_take(8, grant("first"))
    later, small = grant("later"), grant("small")
    assert not budget.try_take(6, later)
    assert not budget.take_now(1)  # others wait: none may overtake them
    assert not budget.try_take(2, small)
    assert budget.withdraw(later)  # gone: the small one behind it fits now
    assert granted == ["small"] and budget.held == 10
    budget.give_back(8)
    budget.give_back(2)
    assert budget.held == 0 and not budget.withdraw(small)  # granted already


def test_a_reply_larger_than_the_budget_goes_alone() -> None:
    budget = ReplyBudget(4)
    assert budget.take_now(100)
    assert not budget.take_now(1)
    budget.give_back(100)
    assert budget.take_now(1) and budget.held == 1


def test_an_await_cancelled_while_waiting_holds_nothing() -> None:
    async def main() -> None:
        budget = ReplyBudget(4)
        await budget.take(4)
        waiting = asyncio.ensure_future(budget.take(4))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        budget.give_back(4)
        assert budget.held == 0
        await asyncio.wait_for(budget.take(4), 1)  # the line is empty: taken at once
        assert budget.held == 4

    asyncio.run(main())
