"""gemps.aio.AsyncClient against a real server, on every route (shared memory, the data plane over
TCP, gRPC): concurrent commits gathered on one event loop are each answered truly and in the
order they were made, a payload is the one the commit was made with, `async with` leaves."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import gemps
from gemps.aio import AsyncClient
from gemps_worker.cluster import ServerProcess
from tests.helpers import stop_process
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")

SIZE = 64
COMMITS = 200
ONES = np.ones(SIZE, np.float32)
ZEROS = {"w": np.zeros(SIZE, np.float32)}


class CommitSaysWhenStarted(gemps.Client):
    """The blocking client, which says when a commit's call begins: past the AsyncClient's queue and
    its gate, so the call runs to its end whatever its awaitable does after."""

    def __init__(self, target: str, **options: Any) -> None:
        super().__init__(target, **options)
        self.commit_started = threading.Event()

    def commit(self, *args: Any, **options: Any) -> gemps.CommitResult:
        self.commit_started.set()
        return super().commit(*args, **options)


def central_of(target: str) -> gemps.CentralVariable:
    """The server's θ as it is, read by an observer of its own."""
    with gemps.Client(target, plane="grpc") as observer:
        return observer.pull()


def test_gathered_commits_are_answered_truly_in_order(start_server: StartServer, plane: str) -> None:
    """Downpour at η 1 adds each "ones" update: the k-th commit made makes version k, θ = k."""
    server = start_server(rule="downpour", learning_rate=1.0)

    async def train() -> list[gemps.CommitResult]:
        async with AsyncClient(server.target, timeout=30.0) as client:
            await client.register(ZEROS)
            assert client.client.planes == ["grpc" if plane == "grpc" else "data"]
            return await asyncio.gather(*(client.commit(ONES, kind="update") for _ in range(COMMITS)))

    results = asyncio.run(train())
    assert [result.version for result in results] == list(range(1, COMMITS + 1))
    for result in results:
        np.testing.assert_array_equal(result.parameters.flat, np.full(SIZE, result.version, np.float32))
    central = central_of(server.target)
    assert central.version == COMMITS
    np.testing.assert_array_equal(central.flat, np.full(SIZE, COMMITS, np.float32))


def test_a_commit_sends_its_payload_as_it_was_when_made(start_server: StartServer) -> None:
    """A trainer computes the next gradient in place while the commit waits its turn."""
    server = start_server(rule="downpour", learning_rate=1.0)
    gradient = np.ones(SIZE, np.float32)

    async def train() -> None:
        async with AsyncClient(server.target) as client:
            await client.register(ZEROS)
            queued = [client.commit(ONES, kind="update") for _ in range(20)]
            queued.append(client.commit(gradient, kind="update"))
            gradient[:] = 1000.0  # the next step's, written over this one's
            await asyncio.gather(*queued)

    asyncio.run(train())
    np.testing.assert_array_equal(central_of(server.target).flat, np.full(SIZE, 21, np.float32))


def test_a_call_cancelled_before_its_turn_is_never_sent(start_server: StartServer) -> None:
    server = start_server(rule="downpour", learning_rate=1.0)

    async def train() -> None:
        async with AsyncClient(server.target) as client:
            await client.register(ZEROS)
            with client.client._calls:  # a call of another thread runs: the client's thread waits
                first = client.commit(ONES, kind="update")
                second = client.commit(ONES, kind="update")  # queued behind the first
                second.cancel()
                await asyncio.sleep(0)  # the cancellation reaches the queue
            assert (await first).version == 1
            with pytest.raises(asyncio.CancelledError):
                await second
            assert (await client.pull()).version == 1

    asyncio.run(train())


def test_a_commit_cancelled_after_it_left_says_it_was_applied() -> None:
    """Issue 61 item 13: the server stopped (SIGSTOP) while a commit is on the wire; the caller
    cancels it and hears CancelledError, yet the commit is applied once the server resumes.
    `outcome` says so (its CommitResult), and None for a commit taken off the queue unsent."""
    with ServerProcess(rule="downpour", learning_rate=1.0, log_level="warning") as server:

        async def train() -> None:
            blocking = CommitSaysWhenStarted(server.target, timeout=60)
            async with AsyncClient(blocking) as client:
                await client.register(ZEROS)
                stop_process(server.pid)
                try:
                    sent = client.commit(ONES, kind="update")
                    queued = client.commit(ONES, kind="update")  # behind it: never sent
                    # The first under way, the server stopped (a 0.5 s sleep here assumed the thread
                    # would have begun it by then).
                    assert await asyncio.to_thread(blocking.commit_started.wait, 60)
                    assert not sent.done(), sent.result()
                    assert sent.cancel() and queued.cancel()
                    for cancelled in (sent, queued):
                        with pytest.raises(asyncio.CancelledError):
                            await cancelled
                finally:
                    os.kill(server.pid, signal.SIGCONT)
                # The loop held: the thread ends the first and takes up the second before any of
                # the loop's callbacks (where wrap_future cancels what it wraps) could run.
                time.sleep(1.0)
                applied = await client.outcome(sent)
                assert applied is not None and applied.version == 1
                assert await client.outcome(queued) is None
                central = await client.pull()
                assert central.version == 1
                np.testing.assert_array_equal(central.flat, ONES)  # applied once
                with pytest.raises(ValueError, match="not an awaitable"):
                    await client.outcome(asyncio.get_running_loop().create_future())

        asyncio.run(train())


def test_async_and_threaded_use_of_one_client_agree(start_server: StartServer) -> None:
    """An AsyncClient around a Client that a thread commits on too: every commit of both counted."""
    server = start_server(rule="downpour", learning_rate=1.0)
    client = gemps.Client(server.target, timeout=30.0)
    client.register(ZEROS)
    versions: list[int] = []

    def commit_in_thread() -> None:
        versions.extend(client.commit(ONES, kind="update").version for _ in range(COMMITS))

    async def commit_beside(thread: threading.Thread) -> None:
        async with AsyncClient(client) as beside:  # leaves and closes `client` at the end
            results = await asyncio.gather(*(beside.commit(ONES, kind="update") for _ in range(COMMITS)))
            versions.extend(result.version for result in results)
            await asyncio.to_thread(thread.join, 300.0)

    thread = threading.Thread(target=commit_in_thread)
    thread.start()
    asyncio.run(commit_beside(thread))
    assert sorted(versions) == list(range(1, 2 * COMMITS + 1))
    assert central_of(server.target).version == 2 * COMMITS


def test_async_with_leaves_the_server_and_a_closed_client_says_so(start_server: StartServer) -> None:
    server = start_server(rule="downpour")

    async def use() -> AsyncClient:
        async with AsyncClient(server.target) as client:
            await client.register(ZEROS)
            assert (await client.status()).active_workers == 1
        return client

    client = asyncio.run(use())
    with gemps.Client(server.target) as observer:
        assert observer.status().workers == ()

    async def again() -> None:
        await client.pull()

    with pytest.raises(RuntimeError, match="AsyncClient is closed"):
        asyncio.run(again())
