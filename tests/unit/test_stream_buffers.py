"""CommitStream's buffer pool: at most `count` buffers out at once, each reused, grown once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gemps_server.wire.stream_buffers import BufferPool


def test_buffers_are_reused_and_grown_only_when_asked_for_more() -> None:
    async def run() -> None:
        pool = BufferPool(1)
        async with pool.buffer() as buffer:
            first = buffer.take(1000)
            first[:] = 7
        async with pool.buffer() as buffer:
            again = buffer.take(800)
            assert np.shares_memory(again, first)  # the same bytes, not a new allocation
            bigger = buffer.take(2000)
            assert bigger.nbytes == 2000 and not np.shares_memory(bigger, first)
            view = buffer.copy_in(b"\x01\x02\x03")
            assert bytes(view) == b"\x01\x02\x03" and np.shares_memory(np.frombuffer(view, np.uint8), bigger)

    asyncio.run(run())


def test_at_most_count_buffers_are_out_at_once() -> None:
    async def run() -> int:
        pool = BufferPool(2)
        inside = most = 0

        async def stream() -> None:
            nonlocal inside, most
            async with pool.buffer() as buffer:
                buffer.take(64)
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                inside -= 1

        await asyncio.gather(*(stream() for _ in range(10)))
        return most

    assert asyncio.run(run()) == 2


def test_a_pool_needs_a_buffer() -> None:
    with pytest.raises(ValueError, match="at least one"):
        BufferPool(0)
