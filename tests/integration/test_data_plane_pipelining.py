"""Issue 42, item 5: registered data-plane connections that pipeline requests and never read
their replies must not hold what honest workers need, and the SDK's `timeout=` bounds a whole
call, retries included (docs/RELIABILITY.md, "Issue 42, item 5").

Before the fix, 4 such connections (P = 1M: a reply fills the socket's buffers) held the
--data-plane-buffers pool for the stall timeout: an honest commit took 28.6 s, and a
`timeout=5` client waited as long (it bounded each attempt, not the call)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gemps import Client, errors
from gemps.aio import AsyncClient
from gemps.retry import RetryPolicy
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess
from tests.data_plane_client import DataPlaneClient, commit_header
from tests.helpers import InProcessServer, stop_process, wait_for
from tests.integration.conftest import StartServer, StartServerProcess, open_stub
from tests.integration.test_data_plane_hostile import refusals

P = 1 << 20  # 4 MiB replies: more than a loopback socket's buffers take from a peer that never reads
ATTACKERS = 4  # as many as the default --data-plane-buffers
PIPELINED = 16  # PULLs each attacker sends without reading a reply
HANG = 5.0  # an honest commit slower than this is held (before the fix: 28 s), not merely slow
COMMITS = 5


def register(stub: pb_grpc.ParameterServerStub) -> pb.RegisterResponse:
    """A worker registered by hand (its data-plane offer in the reply) with a server whose θ of P
    values is set."""
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    return stub.Register(pb.RegisterRequest(spec=spec, omit_parameters=True))


@contextlib.contextmanager
def pipelining_attackers(server: InProcessServer) -> Iterator[list[DataPlaneClient]]:
    """ATTACKERS registered workers' connections, each past its HELLO, that send PIPELINED PULLs
    of θ and read nothing."""
    stub = open_stub(server.target)
    attackers: list[DataPlaneClient] = []
    try:
        for _ in range(ATTACKERS):
            reply = register(stub)
            client = DataPlaneClient(reply.data_plane.port, timeout=30)
            attackers.append(client)
            assert client.hello(reply.worker_id, reply.data_plane.ticket).error is None
            request = pb.PullRequest(worker_id=reply.worker_id, known_version=-1).SerializeToString()
            for _ in range(PIPELINED):
                client.send(Op.PULL, request)
        yield attackers
    finally:
        for client in attackers:
            client.close()


def timed_commits(client: Client, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        began = time.monotonic()
        client.commit(np.full(P, 1e-3, np.float32))
        seconds.append(time.monotonic() - began)
    return seconds


@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shared"])
def test_pipelined_unread_pulls_do_not_hold_an_honest_workers_commits(
    start_server: StartServer, shared_memory: bool
) -> None:
    server = start_server(rule="downpour")
    values = {"w": np.linspace(-1, 1, P, dtype=np.float32)}
    with Client(server.target, plane="data", shared_memory=shared_memory) as honest:
        honest.register(values)
        timed_commits(honest, 2)  # connected, and proven fast on the fast lane
        with pipelining_attackers(server):
            time.sleep(0.5)  # the attackers' replies fill their sockets' buffers
            seconds = timed_commits(honest, COMMITS)
            assert max(seconds) < HANG, f"honest commits held by unread replies: {seconds}"
            began = time.monotonic()
            with Client(server.target, plane="data", shared_memory=shared_memory) as newcomer:
                newcomer.register(values)
                timed_commits(newcomer, 1)
            assert time.monotonic() - began < 2 * HANG, "a new client held by unread replies"
            # A connection that keeps sending requests while its reply goes unread is closed.
            wait_for(lambda: refusals(server)["unread_replies"] >= ATTACKERS, timeout=HANG, what="attackers closed")
        assert honest.status().commits_applied == 2 + COMMITS + 1


def test_a_pull_never_read_holds_no_pooled_buffer(start_server: StartServer) -> None:
    """One buffer in the pool, and a connection that pulls θ and never reads the reply (no
    pipelining: it is not closed for that) - the honest commit still goes through at once."""
    server = start_server(rule="downpour", data_plane_buffers=1)
    values = {"w": np.zeros(P, np.float32)}
    with Client(server.target, plane="data", shared_memory=False) as honest:
        honest.register(values)
        timed_commits(honest, 1)
        reply = register(open_stub(server.target))
        with DataPlaneClient(reply.data_plane.port, timeout=30) as reader:
            assert reader.hello(reply.worker_id, reply.data_plane.ticket).error is None
            for _ in range(3):  # one at a time, each read only up to its first bytes
                reader.send(Op.PULL, pb.PullRequest(worker_id=reply.worker_id).SerializeToString())
            time.sleep(0.5)
            assert max(timed_commits(honest, COMMITS)) < HANG


def test_a_commit_reply_never_read_gives_its_pooled_buffer_back(start_server: StartServer) -> None:
    """One buffer in the pool, and a worker that commits and never reads the reply (θ, copied into
    that buffer): the rest of the reply moves out of it, and the honest commit goes through."""
    server = start_server(rule="downpour", data_plane_buffers=1)
    values = {"w": np.zeros(P, np.float32)}
    with Client(server.target, plane="data", shared_memory=False) as honest:
        honest.register(values)
        timed_commits(honest, 1)
        reply = register(open_stub(server.target))
        with DataPlaneClient(reply.data_plane.port, timeout=30) as reader:
            assert reader.hello(reply.worker_id, reply.data_plane.ticket).error is None
            payload = np.zeros(P, np.float32).tobytes()
            reader.send(Op.COMMIT, commit_header(reply.worker_id, P, reply.version), payload)
            time.sleep(0.5)
            assert max(timed_commits(honest, COMMITS)) < HANG
            frame = reader.receive()  # the reply moved out of the buffer comes whole
            assert frame.op == Op.COMMIT | REPLY and len(frame.payload) == 4 * P, frame.error
        assert honest.status().commits_applied == 1 + 1 + COMMITS


def stopped(server: ServerProcess) -> contextlib.AbstractContextManager[None]:
    """The server process SIGSTOPped meanwhile: its sockets stay open, nothing is answered."""

    def state() -> str:  # /proc/PID/stat's third field: T once every thread has stopped
        return Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        stop_process(server.pid)
        try:
            wait_for(lambda: state() == "T", timeout=5, what="the server stopped")
            yield
        finally:
            os.kill(server.pid, signal.SIGCONT)

    return held()


TIMEOUT = 2.0
MARGIN = 1.5  # the time the error itself takes to come (a loaded machine's scheduling)


def test_timeout_bounds_the_whole_call_retries_included(start_server_process: StartServerProcess, plane: str) -> None:
    """Against a server that never answers (each attempt times out) or is gone (each is refused at
    once, and retried), the call ends with DeadlineExceededError once `timeout` is spent (before:
    each of 50 attempts got its own `timeout`, plus the backoff between them). On every route
    (the `plane` fixture: shared memory, TCP data plane, gRPC)."""
    server = start_server_process(rule="downpour")
    values = {"w": np.zeros(1000, np.float32)}
    client = Client(server.target, timeout=TIMEOUT, retry=RetryPolicy(max_attempts=50))
    try:
        client.register(values)
        client.commit(values)
        with stopped(server):
            for call in (lambda: client.commit(values), client.pull, client.status):
                began = time.monotonic()
                with pytest.raises(errors.DeadlineExceededError):
                    call()
                took = time.monotonic() - began
                assert took < TIMEOUT + MARGIN, f"a call with timeout={TIMEOUT} took {took:.1f}s"
        server.kill()  # now refused at once: retried, with backoff, until the timeout is spent
        began = time.monotonic()
        with pytest.raises(errors.DeadlineExceededError):
            client.commit(values)
        assert time.monotonic() - began < TIMEOUT + MARGIN
        assert client.retries > 0
    finally:
        client.close()  # not leave: the server was stopped


def test_the_asyncio_clients_timeout_bounds_each_call_from_when_it_is_made(
    start_server_process: StartServerProcess,
) -> None:
    server = start_server_process(rule="downpour")
    values = {"w": np.zeros(1000, np.float32)}

    async def main() -> None:
        client = AsyncClient(server.target, timeout=TIMEOUT, retry=RetryPolicy(max_attempts=50))
        await client.register(values)
        with stopped(server):
            began = time.monotonic()
            calls = [client.commit(values), client.commit(values)]  # the second queued behind the first
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            took = time.monotonic() - began
        await client.close()
        assert all(isinstance(outcome, errors.DeadlineExceededError) for outcome in outcomes), outcomes
        assert took < TIMEOUT + MARGIN, f"two queued calls with timeout={TIMEOUT} took {took:.1f}s"

    asyncio.run(main())
