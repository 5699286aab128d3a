"""The data plane (DESIGN §3c): commits and pulls with θ's raw bytes on a port beside gRPC, with
the gRPC path's semantics: the same applier, ledger, refusals and reasons, one θ."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import cast

import grpc
import numpy as np
import pytest

from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.reasons import Reason
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.data_plane_client import DataPlaneClient, commit_header, theta_of
from tests.helpers import InProcessServer, scrape_series, start_partitions, wait_for
from tests.integration.conftest import StartServer, open_stub

P = 1000
LEARNING_RATE = 0.1


def register(
    stub: pb_grpc.ParameterServerStub, client_id: str = "", initial: np.ndarray | None = None
) -> pb.RegisterResponse:
    values = np.linspace(-1, 1, P, dtype=np.float32) if initial is None else initial
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    return stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(values), client_id=client_id))


def connected(reply: pb.RegisterResponse) -> DataPlaneClient:
    """A data-plane connection of the registration `reply`, its HELLO answered."""
    client = DataPlaneClient(reply.data_plane.port)
    answer = client.hello(reply.worker_id, reply.data_plane.ticket)
    assert answer.op == Op.HELLO | REPLY, answer.error
    return client


def grpc_commit(
    stub: pb_grpc.ParameterServerStub, worker_id: str, gradient: np.ndarray, base: int, request_id: str = ""
) -> pb.CommitResponse:
    return stub.Commit(
        pb.CommitRequest(
            worker_id=worker_id,
            base_version=base,
            kind=pb.PAYLOAD_KIND_GRADIENT,
            payload=tensor_to_proto(gradient),
            request_id=request_id,
        )
    )


def grpc_theta(stub: pb_grpc.ParameterServerStub) -> tuple[int, np.ndarray]:
    reply = stub.Pull(pb.PullRequest(known_version=-1))
    return reply.version, np.frombuffer(reply.parameters.data, np.float32)


@pytest.fixture
def downpour(start_server: StartServer) -> InProcessServer:
    return start_server(rule="downpour", learning_rate=LEARNING_RATE)


def gradients(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(P).astype(np.float32) for _ in range(count)]


def test_commits_over_the_data_plane_move_theta_as_downpour_and_as_over_grpc(start_server: StartServer) -> None:
    """θ after commits on the data plane is DESIGN §1's DOWNPOUR, and bit for bit what the same
    commits give over gRPC on another server."""
    thetas = []
    for plane in ("data", "grpc"):
        server = start_server(rule="downpour", learning_rate=LEARNING_RATE)
        stub = open_stub(server.target)
        reply = register(stub)
        version = reply.version
        for gradient in gradients(5):
            if plane == "data":
                with connected(reply) as client:
                    frame = client.commit(reply.worker_id, gradient, version)
                header = frame.message(pb.CommitResponse)
                assert isinstance(header, pb.CommitResponse)
                assert list(header.parameters.shape) == [P] and not header.parameters.data
                np.testing.assert_array_equal(theta_of(frame), grpc_theta(stub)[1])
            else:
                header = grpc_commit(stub, reply.worker_id, gradient, version)
            assert header.version == version + 1
            version = header.version
        thetas.append(grpc_theta(stub)[1])
    expected: np.ndarray = np.linspace(-1, 1, P, dtype=np.float32)
    for gradient in gradients(5):
        expected = expected + np.float32(-LEARNING_RATE) * gradient
    np.testing.assert_allclose(thetas[0], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(thetas[0], thetas[1])


def test_pull_over_the_data_plane_and_unchanged(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    reply = register(stub)
    with connected(reply) as client:
        frame = client.pull(reply.worker_id)
        header = frame.message(pb.PullResponse)
        assert isinstance(header, pb.PullResponse)
        np.testing.assert_array_equal(theta_of(frame), grpc_theta(stub)[1])
        again = client.pull(reply.worker_id, header.version, header.history)
        unchanged = again.message(pb.PullResponse)
        assert isinstance(unchanged, pb.PullResponse)
        assert unchanged.unchanged and again.payload == b""


def test_the_ledger_is_shared_with_grpc_one_request_id_applies_once(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    reply = register(stub, client_id="ledger-client")
    (gradient,) = gradients(1)
    with connected(reply) as client:
        first = client.commit(reply.worker_id, gradient, 0, request_id="r-1").message(pb.CommitResponse)
        again = client.commit(reply.worker_id, gradient, 0, request_id="r-1").message(pb.CommitResponse)
        assert isinstance(first, pb.CommitResponse) and isinstance(again, pb.CommitResponse)
        assert first.version == again.version == 1
        by_grpc = grpc_commit(stub, reply.worker_id, gradient, 0, request_id="r-1")
        assert by_grpc.version == 1
        # ... and the other way round: applied over gRPC, retried on the data plane.
        grpc_commit(stub, reply.worker_id, gradient, 1, request_id="r-2")
        retried = client.commit(reply.worker_id, gradient, 1, request_id="r-2").message(pb.CommitResponse)
        assert isinstance(retried, pb.CommitResponse) and retried.version == 2
    assert downpour.server.state.core.commits_applied == 2


def test_fifo_across_planes_every_commit_applied_once(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    data_reply, grpc_reply = register(stub, "data-side"), register(stub, "grpc-side")
    versions: dict[str, list[int]] = {"data": [], "grpc": []}
    count = 150
    gradient = np.full(P, 1e-3, np.float32)

    def data_side() -> None:
        with connected(data_reply) as client:
            for i in range(count):
                header = client.commit(data_reply.worker_id, gradient, 0, request_id=f"d{i}").message(pb.CommitResponse)
                assert isinstance(header, pb.CommitResponse)
                versions["data"].append(header.version)

    def grpc_side() -> None:
        for i in range(count):
            versions["grpc"].append(grpc_commit(stub, grpc_reply.worker_id, gradient, 0, request_id=f"g{i}").version)

    threads = [threading.Thread(target=data_side), threading.Thread(target=grpc_side)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for side in versions.values():
        assert len(side) == count and all(a < b for a, b in itertools.pairwise(side))
    assert sorted(versions["data"] + versions["grpc"]) == list(range(1, 2 * count + 1))
    assert downpour.server.state.core.commits_applied == 2 * count


def test_a_nan_payload_is_refused_like_grpc_and_the_connection_stays_usable(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    reply = register(stub)
    before = grpc_theta(stub)
    bad = np.full(P, np.nan, np.float32)
    with connected(reply) as client:
        error = client.commit(reply.worker_id, bad, 0).error
        assert error is not None
        assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], Reason.NON_FINITE.value)
        with pytest.raises(grpc.RpcError) as refused:
            grpc_commit(stub, reply.worker_id, bad, 0)
        assert refused.value.details() == error.message  # the same words as gRPC's
        np.testing.assert_array_equal(grpc_theta(stub)[1], before[1])
        ok = client.commit(reply.worker_id, np.zeros(P, np.float32), 0)
        assert ok.op == Op.COMMIT | REPLY
    # A call's duration and bytes are counted once its reply has left (sent bytes last), so the
    # client can read the reply before the server has counted it: wait for θ's bytes.
    sent = 'gemps_sent_bytes_total{method="Commit",plane="data"}'
    url = f"http://127.0.0.1:{downpour.metrics_port}/metrics"

    def counted() -> dict[str, float] | None:
        series = scrape_series(url)
        return series if series[sent] > 4 * P else None

    series = wait_for(counted, timeout=10, what="the commits counted")
    assert series['gemps_commits_total{outcome="rejected",reason="non_finite"}'] == 2
    assert series['gemps_rpc_duration_seconds_count{method="Commit",plane="data"}'] == 2
    # Whole frames: two payloads of 4P bytes in, one θ of 4P bytes out (and their headers).
    assert 8 * P < series['gemps_received_bytes_total{method="Commit",plane="data"}'] < 8 * P + 512
    assert 4 * P < series[sent] < 4 * P + 512


def test_unknown_worker_and_bad_base_version_keep_the_connection(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    reply = register(stub)
    with connected(reply) as client:
        error = client.commit(reply.worker_id, np.zeros(P, np.float32), 99).error
        assert error is not None and error.reason == Reason.BAD_VERSION.value
        stub.Leave(pb.LeaveRequest(worker_id=reply.worker_id))  # now the worker is unknown
        error = client.commit(reply.worker_id, np.zeros(P, np.float32), 0).error
        assert error is not None
        assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND.value[0], Reason.UNKNOWN_WORKER.value)
        error = client.pull(reply.worker_id).error
        assert error is not None and error.reason == Reason.UNKNOWN_WORKER.value


@pytest.mark.parametrize(
    "dtype",
    [pb.DTYPE_INT8_BLOCK, pb.DTYPE_INT4_BLOCK, pb.DTYPE_TOPK_BLOCK, pb.DTYPE_INT64, cast(pb.DType, 77)],
    ids=str,
)
def test_a_pull_in_an_encoding_replies_cannot_carry_is_a_bad_argument_not_an_internal_error(
    downpour: InProcessServer, dtype: pb.DType, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 61 item 6: answered INTERNAL with a traceback logged per request before; now refused
    as gRPC refuses it (INVALID_ARGUMENT, bad_dtype, the same words), the connection kept."""
    stub = open_stub(downpour.target)
    reply = register(stub)
    with connected(reply) as client, caplog.at_level(logging.WARNING):
        for _ in range(3):
            error = client.pull(reply.worker_id, reply_dtype=dtype).error
            assert error is not None
            assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], Reason.BAD_DTYPE.value)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Pull(pb.PullRequest(worker_id=reply.worker_id, known_version=-1, reply_dtype=dtype))
        assert error is not None and refused.value.details() == error.message
        assert client.pull(reply.worker_id).op == Op.PULL | REPLY
    assert not [record for record in caplog.records if record.exc_info], "a traceback was logged"


def test_a_wrong_size_announced_is_refused_unread_and_closed(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    reply = register(stub)
    before = grpc_theta(stub)
    with connected(reply) as client:
        client.send(Op.COMMIT, commit_header(reply.worker_id, P + 1, 0), b"")  # announces P+1 values, sends none
        frame = client.receive()
        assert frame.error is not None and frame.error.reason == Reason.BAD_SHAPE.value
        assert client.closed_by_server()
    with connected(reply) as client:
        client.send(Op.COMMIT, commit_header(reply.worker_id, P, 0), b"", payload_bytes=4 * P - 4)
        frame = client.receive()
        assert frame.error is not None and frame.error.reason == Reason.BAD_PAYLOAD.value
        assert client.closed_by_server()
    np.testing.assert_array_equal(grpc_theta(stub)[1], before[1])
    assert downpour.server.state.core.version == 0


def test_a_wrong_ticket_is_refused_before_any_payload_is_read(downpour: InProcessServer) -> None:
    stub = open_stub(downpour.target)
    reply, other = register(stub, "one"), register(stub, "two")
    for worker_id, ticket in ((reply.worker_id, other.data_plane.ticket), (reply.worker_id, b"\0" * 32)):
        with DataPlaneClient(reply.data_plane.port) as client:
            frame = client.hello(worker_id, ticket)
            assert frame.error is not None
            assert frame.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert client.closed_by_server()
    with DataPlaneClient(reply.data_plane.port) as client:  # a commit right behind the bad hello
        client.challenge(reply.worker_id)
        client.send(Op.HELLO, pb.DataPlaneHello(worker_id=reply.worker_id, proof=b"x").SerializeToString())
        client.send(Op.COMMIT, commit_header(reply.worker_id, P, 0), np.zeros(P, np.float32).tobytes())
        assert client.receive().error is not None
        assert client.closed_by_server()
    with DataPlaneClient(reply.data_plane.port) as client:
        frame = client.hello("no-such-worker", b"x" * 32)
        assert frame.error is not None and frame.error.reason == Reason.UNKNOWN_WORKER.value
    with connected(reply) as client:  # another worker's requests on this worker's connection
        frame = client.commit(other.worker_id, np.zeros(P, np.float32), 0)
        assert frame.error is not None and frame.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert client.closed_by_server()
    assert downpour.server.state.core.version == 0
    series = scrape_series(f"http://127.0.0.1:{downpour.metrics_port}/metrics")
    assert series['gemps_data_plane_refusals_total{reason="unauthenticated"}'] == 3
    assert series['gemps_data_plane_refusals_total{reason="unknown_worker"}'] == 1


def _ports_this_process_listens_on() -> set[int]:
    """TCP ports a socket open in this process listens on (/proc: the kernel's table of the
    network namespace, kept to the sockets whose inodes this process's descriptors hold)."""
    inodes: set[str] = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed since listed
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            for row in itertools.islice(rows, 1, None):
                fields = row.split()
                listening = fields[3] == "0A"
                if listening and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_data_plane_off_announces_nothing_and_listens_nowhere(start_server: StartServer) -> None:
    on = start_server()
    on_port = register(open_stub(on.target)).data_plane.port
    assert on_port == on.server.data_port > 0
    assert on_port in _ports_this_process_listens_on()
    on.stop()  # before the next one starts: servers stop last-in first-out (each restores the log level)
    # Not "a connection is refused": another test's process may bind the freed port at once (CI did).
    assert on_port not in _ports_this_process_listens_on()
    off = start_server(data_plane="off")
    reply = register(open_stub(off.target))
    assert not reply.HasField("data_plane")
    assert off.server.data_port == 0 and off.server.data_plane is None


def test_each_partition_announces_its_own_data_plane(start_server: StartServer) -> None:
    """With K partitions every process has its own data port and ticket; a commit's slices sent
    on each move θ as one server would (DOWNPOUR, elementwise)."""
    servers = start_partitions(start_server, 2, rule="downpour", learning_rate=LEARNING_RATE)
    initial = np.linspace(-1, 1, P, dtype=np.float32)
    replies = [register(open_stub(server.target), "partitioned", initial) for server in servers]
    ports = {reply.data_plane.port for reply in replies}
    assert len(ports) == 2 and ports == {server.server.data_port for server in servers}
    (gradient,) = gradients(1)
    start = 0
    for server, reply in zip(servers, replies, strict=True):
        size = server.server.state.core.num_parameters
        with connected(reply) as client:
            frame = client.commit(reply.worker_id, gradient[start : start + size], 0)
            np.testing.assert_allclose(
                theta_of(frame), (initial - np.float32(LEARNING_RATE) * gradient)[start : start + size], rtol=1e-6
            )
        start += size
    assert start == P
