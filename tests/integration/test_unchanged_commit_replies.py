"""A commit whose reply would carry the θ its client already holds carries none (CommitRequest.
known_history, CommitResponse.unchanged): under adamw, every commit that joins an open round.
Measured by the client's own byte counter on each way a reply travels (gRPC whole and in pieces,
the data plane's socket and its shared memory), with θ the same bits as the server's throughout;
and θ still sent to a client that names no history, a history not the server's, a gradient
dropped for its round, and a client of difference replies."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import gemps
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.helpers import start_partitions
from tests.integration.conftest import StartServer

P = 32
WORKERS = 2  # a round is both workers' gradients
ROUNDS = 3
#: how a reply travels: the client's options for each
WAYS: dict[str, dict[str, object]] = {
    "grpc-unary": {"plane": "grpc", "streaming": "never"},
    "grpc-stream": {"plane": "grpc", "streaming": "always"},
    "data-socket": {"plane": "data", "shared_memory": False},
    "data-shared-memory": {"plane": "data", "shared_memory": True},
}


def received_by_commits(registry: CollectorRegistry) -> float:
    """Bytes of θ this client's commits' replies carried (gemps_client_received_bytes)."""
    return registry.get_sample_value("gemps_client_received_bytes_total", {"call": "commit"}) or 0.0


@contextmanager
def workers(target: str, options: dict[str, object]) -> Iterator[list[tuple[gemps.Client, CollectorRegistry]]]:
    """Two registered clients of `options`, each with its own metrics registry."""
    registries = [CollectorRegistry() for _ in range(WORKERS)]
    clients = [
        gemps.Client(target, name=f"w{i}", metrics_registry=registries[i], **options)  # type: ignore[arg-type]
        for i in range(WORKERS)
    ]
    try:
        for client in clients:
            client.register({"theta": np.zeros(P, np.float32)})
        yield list(zip(clients, registries, strict=True))
    finally:
        for client in clients:
            client.close()


def rounds_of_two(target: str, options: dict[str, object]) -> None:
    """ROUNDS rounds of both workers' gradients: the first commit of each joins the round and gets
    no θ back, the second closes it and gets θ whole; both then hold the server's θ, bit for bit."""
    with workers(target, options) as pair, ThreadPoolExecutor(1) as executor:
        (first, first_bytes), (second, second_bytes) = pair
        for round_ in range(ROUNDS):
            gradient = np.full(P, round_ + 1.0, np.float32)
            before = received_by_commits(first_bytes), received_by_commits(second_bytes)
            # The first gradient joins the round and its commit waits for θ to move (gemps.rounds).
            waiting = executor.submit(first.commit, gradient, num_samples=1)
            threading.Event().wait(0.2)
            closed = second.commit(-gradient / 2, num_samples=1)
            joined = waiting.result(timeout=60)
            assert joined.round_pending == 1 and closed.round_pending == 0, (joined, closed)
            assert received_by_commits(first_bytes) == before[0], "the joining commit's reply carried θ"
            assert received_by_commits(second_bytes) == before[1] + 4 * P, "the closing commit's reply: θ whole"
            with gemps.Client(target) as observer:
                central = observer.pull()
            assert central.version == 2 * (round_ + 1)
            for result in (joined, closed):  # each holds the server's θ, bit for bit
                assert result.parameters.version == central.version
                np.testing.assert_array_equal(np.asarray(result.parameters.flat), np.asarray(central.flat))
        assert not np.array_equal(np.asarray(central.flat), np.zeros(P, np.float32))  # θ moved every round


@pytest.mark.parametrize("way", list(WAYS))
def test_a_commit_that_joins_a_round_gets_no_theta_back(start_server: StartServer, way: str) -> None:
    server = start_server(rule="adamw", learning_rate=0.05)
    rounds_of_two(server.target, WAYS[way])


def test_on_partitions_each_servers_reply_carries_no_theta_while_its_round_is_open(start_server: StartServer) -> None:
    """Two partitions, each its own round: the SDK keeps each slice it holds, numbered on."""
    servers = start_partitions(start_server, 2, rule="adamw", learning_rate=0.05, num_shards=0)
    rounds_of_two(servers[0].target, {})


def commit_request(worker_id: str, base_version: int, known_history: str, **fields: object) -> pb.CommitRequest:
    payload = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[P], data=np.ones(P, np.float32).tobytes())
    return pb.CommitRequest(
        worker_id=worker_id,
        base_version=base_version,
        kind=pb.PAYLOAD_KIND_GRADIENT,
        payload=payload,
        known_history=known_history,
        **fields,  # type: ignore[arg-type]
    )


def test_theta_is_sent_unless_the_commit_names_the_servers_history_and_holds_its_theta(
    start_server: StartServer,
) -> None:
    """Raw Commit calls, one of a round of three each: θ comes back to a commit that names no
    history or another's, to a gradient taken before the round's θ (dropped), and to a client of
    difference replies; none to one that names the server's history and holds the round's θ."""
    server = start_server(rule="adamw", learning_rate=0.05)
    with ExitStack() as registered, grpc.insecure_channel(server.target) as channel:
        clients = [registered.enter_context(gemps.Client(server.target)) for _ in range(3)]  # a round of three
        for client in clients:
            client.register({"theta": np.zeros(P, np.float32)})
        ids = [client.worker_id or "" for client in clients]
        assert all(ids)
        stub = pb_grpc.ParameterServerStub(channel)
        history = stub.Pull(pb.PullRequest(worker_id=ids[0], known_version=-1)).history
        assert history
        for named in ("", "another-servers-history"):  # no history, or one not the server's: θ sent
            reply = stub.Commit(commit_request(ids[0], 0, named))
            assert not reply.unchanged and len(reply.parameters.data) == 4 * P, named
        # The round of three has two; a difference-reply client's commit closes it: θ as a difference.
        reply = stub.Commit(commit_request(ids[1], 0, history, reply_dtype=pb.DTYPE_INT8_BLOCK))
        assert reply.round_pending == 0 and not reply.unchanged and reply.parameters.data
        moved = reply.version  # θ moved: the next round starts here
        joined = stub.Commit(commit_request(ids[0], moved, history))
        assert joined.unchanged and joined.round_pending == 2 and not joined.HasField("parameters")
        assert joined.version == moved + 1
        # A gradient taken on θ before this round: dropped, and answered with the round's θ.
        dropped = stub.Commit(commit_request(ids[2], 0, history))
        assert dropped.round_pending == 0 and not dropped.unchanged and len(dropped.parameters.data) == 4 * P
        pulled = stub.Pull(pb.PullRequest(worker_id=ids[2], known_version=-1))
        assert dropped.parameters.data == pulled.parameters.data
