"""A pull held until θ moves (PullRequest.wait_seconds; gemps_server/theta_waits.py): answered by
the commit that moves θ, on both planes; unchanged when its wait passes or the server stops; a wait
out of range refused, naming it; and a worker waiting for its round through one held pull, where
it polled."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps.records import CentralVariable
from gemps_proto.reasons import Reason
from gemps_proto.schema import MAX_PULL_WAIT_SECONDS
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.helpers import InProcessServer, scrape_series, wait_for
from tests.integration.conftest import StartServer

P = 16


def held_pull(
    executor: ThreadPoolExecutor, client: gemps.Client, server: InProcessServer, wait: float
) -> Future[CentralVariable]:
    """`client.pull(wait=wait)` on another thread, once the server holds it."""
    pulled = executor.submit(client.pull, wait=wait)
    wait_for(lambda: len(server.server.service.waits) == 1, 10, "the pull held")
    return pulled


@pytest.mark.parametrize("plane", ["grpc", "data"])
def test_a_held_pull_is_answered_by_the_commit_that_moves_theta(start_server: StartServer, plane: str) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target, plane=plane) as waiting, gemps.Client(server.target) as committing:
        waiting.register({"w": np.zeros(P, np.float32)})
        committing.register({"w": np.zeros(P, np.float32)})
        with ThreadPoolExecutor(1) as executor:
            pulled = held_pull(executor, waiting, server, wait=MAX_PULL_WAIT_SECONDS)
            assert not pulled.done()  # held: θ is the one it holds
            committing.commit(np.ones(P, np.float32), kind="update")
            central: CentralVariable = pulled.result(timeout=MAX_PULL_WAIT_SECONDS)
    assert central.version == 1
    np.testing.assert_array_equal(np.asarray(central.flat), np.ones(P, np.float32))
    assert len(server.server.service.waits) == 0


@pytest.mark.parametrize("plane", ["grpc", "data"])
def test_a_held_pull_whose_wait_passes_is_answered_unchanged(start_server: StartServer, plane: str) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target, plane=plane) as client:
        client.register({"w": np.zeros(P, np.float32)})
        started = time.monotonic()
        central = client.pull(wait=0.5)
        assert central.version == 0 and time.monotonic() - started >= 0.5  # held its wait, not answered at once
    assert len(server.server.service.waits) == 0


def test_a_server_that_stops_answers_its_held_pulls_at_once(start_server: StartServer) -> None:
    """Stopping with a grace of 5 s, a pull held for 8: answered unchanged as the stop begins (before:
    held past the grace, and cancelled with it)."""
    server = start_server(rule="downpour")
    with gemps.Client(server.target, retry=gemps.RetryPolicy(max_attempts=1)) as client:
        client.register({"w": np.zeros(P, np.float32)})
        with ThreadPoolExecutor(1) as executor:
            pulled = held_pull(executor, client, server, wait=8.0)
            stopping = threading.Thread(target=server.stop, kwargs={"grace": 5.0})
            stopping.start()
            assert pulled.result(timeout=30).version == 0  # a reply, not the grace's cancellation
            stopping.join(timeout=60)


def test_no_more_than_half_the_concurrent_calls_are_held(start_server: StartServer) -> None:
    """--max-concurrent-rpcs 4: two pulls held, a third answered at once (unchanged), so held pulls
    never take the room commits need (before: each held its call for its whole wait)."""
    server = start_server(rule="downpour", max_concurrent_rpcs=4)
    clients = [gemps.Client(server.target, plane="grpc") for _ in range(3)]
    try:
        for client in clients:
            client.register({"w": np.zeros(P, np.float32)})
        with ThreadPoolExecutor(2) as executor:
            held = [executor.submit(client.pull, wait=8.0) for client in clients[:2]]
            wait_for(lambda: len(server.server.service.waits) == 2, 10, "two pulls held")
            assert clients[2].pull(wait=8.0).version == 0  # answered at once: no third held
            assert len(server.server.service.waits) == 2 and not any(pull.done() for pull in held)
            clients[2].commit(np.ones(P, np.float32), kind="update")
            assert [pull.result(timeout=10).version for pull in held] == [1, 1]
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("wait", [-1.0, math.nan, math.inf, MAX_PULL_WAIT_SECONDS + 0.5])
def test_a_wait_out_of_range_is_refused_naming_it(server: InProcessServer, wait: float) -> None:
    with gemps.Client(server.target) as client:
        client.register({"w": np.zeros(P, np.float32)})
        with pytest.raises(ValueError, match=r"wait .* must be within"):
            client.pull(wait=wait)
        with grpc.insecure_channel(server.target) as channel:
            request = pb.PullRequest(worker_id=client.worker_id, known_version=0, wait_seconds=wait)
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.ParameterServerStub(channel).Pull(request, timeout=10)
    error: Any = refused.value  # a grpc.Call too
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wait_seconds" in error.details()
    trailing: dict[str, str] = dict(error.trailing_metadata() or ())
    assert trailing["gemps-reason"] == Reason.BAD_WAIT


def test_a_worker_waiting_for_its_round_hears_of_its_close_through_one_held_pull(start_server: StartServer) -> None:
    """Two workers a round under adamw: the first commits, the second 1.5 s later; the first's
    commit comes back with θ after the round from one pull held by the server (before: a poll
    every 1-20 ms, tens of pulls)."""
    server = start_server(rule="adamw", learning_rate=0.01)
    with gemps.Client(server.target) as first, gemps.Client(server.target) as second:
        for client in (first, second):
            client.register({"w": np.zeros(P, np.float32)})
        pulls_before = pulls(server)
        late = threading.Timer(1.5, lambda: second.commit(np.ones(P, np.float32)))
        late.start()
        result = first.commit(np.ones(P, np.float32))
        late.join()
    assert result.round_pending == 1 and result.parameters.version == 2
    assert pulls(server) - pulls_before == 1


def pulls(server: InProcessServer) -> float:
    """Pull RPCs the server answered (both planes), from its metrics page."""
    page = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    return sum(
        value for name, value in page.items() if name.startswith('gemps_rpc_duration_seconds_count{method="Pull')
    )
