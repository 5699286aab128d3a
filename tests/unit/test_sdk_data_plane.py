"""The SDK's data-plane pieces without a server: the headers it shares with the gRPC path, replies
read into the same records, refusals into the same errors, frames over a socket pair."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from gemps import data_plane_link, data_plane_transport, errors
from gemps import grpc_messages as messages
from gemps.channel_security import ChannelSecurity
from gemps.client import Client
from gemps.data_plane_connection import DataConnection, ServerNotProven, target_host
from gemps.data_plane_replies import read_committed, read_pulled
from gemps.data_plane_transport import DataPlaneTransport
from gemps.grpc_transport import GrpcTransport
from gemps.transport import CommitCall, PullCall
from gemps.wire_options import resolve_plane
from gemps_proto import grpc_framing
from gemps_proto.data_plane_events import NEED_DATA, Answer
from gemps_proto.data_plane_frames import REPLY, Op, frame_start, read_preamble
from gemps_proto.data_plane_protocol import ServerConnection
from gemps_proto.reasons import Reason
from gemps_proto.schema import Buffers, DataPlane, PayloadKind
from gemps_proto.schema_proto import set_buffers
from gemps_proto.tensor_codec import BFLOAT16, FLOAT32, encode, wire_view
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.data_plane_client import answer_handshake
from tests.helpers import free_port

THETA = np.linspace(-2, 2, 1000, dtype=np.float32)
CALL = CommitCall(
    worker_id="w1",
    base_version=3,
    kind=PayloadKind.UPDATE,
    payload=np.arange(10, dtype=np.float32),
    loss=0.5,
    num_samples=32,
    request_id="r1",
    buffer_delta=Buffers(np.ones(2, np.float32), np.array([1], np.int64)),
)


@pytest.fixture
def pair() -> Iterator[tuple[DataConnection, socket.socket]]:
    """A connection past its HELLO and the socket of the "server" at its other end."""
    client, server = socket.socketpair()
    client.settimeout(5)
    connection = DataConnection(client, "test", "test")
    answering = threading.Thread(target=answer_handshake, args=(server, b"t" * 32, "test"))
    answering.start()
    connection.hello("w1", b"t" * 32)
    answering.join(5)
    yield connection, server
    connection.close()
    server.close()


# -- requests: the gRPC path's messages, their tensors announced ------------------------------------


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
def test_a_data_plane_commit_header_is_the_grpc_request_without_its_data(dtype: int) -> None:
    data = wire_view(CALL.payload, dtype)
    unary = pb.CommitRequest.FromString(messages.commit_request(CALL, dtype, dtype, data))
    announced = messages.announced_commit(CALL, dtype)
    assert unary.payload.data == bytes(data) and not announced.payload.data
    assert (announced.payload.dtype, list(announced.payload.shape)) == (dtype, [10])
    unary.payload.data = b""
    assert announced == unary  # every other field the same, the buffer delta whole
    assert announced.buffer_delta.data == encode(np.ones(2, np.float32))
    assert announced.integer_buffer_delta.data == np.array([1], "<i8").tobytes()
    streamed = messages.commit_request(CALL, dtype, dtype, data, streamed=True)
    assert streamed == pb.CommitChunk(header=announced).SerializeToString()


def test_a_pull_request_is_the_same_on_both_planes() -> None:
    request = pb.PullRequest.FromString(messages.pull_request(PullCall("w1", 7, "h", 100), BFLOAT16))
    assert (request.worker_id, request.known_version, request.known_history) == ("w1", 7, "h")
    assert request.reply_dtype == BFLOAT16


# -- replies: read into the records the gRPC path builds --------------------------------------------


def commit_response() -> pb.CommitResponse:
    reply = pb.CommitResponse(version=4, staleness=1, scaling_mean=0.5, scaling_median=0.25, scaling_at_max=2.0)
    set_buffers(
        reply.buffers, reply.integer_buffers, Buffers(np.array([1, 2, 3], np.float32), np.array([2**40], np.int64))
    )
    return reply


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
def test_a_commit_reply_reads_as_the_grpc_reply_does(pair: tuple[DataConnection, socket.socket], dtype: int) -> None:
    connection, server = pair
    reply, data = commit_response(), encode(THETA, dtype)
    unary = messages.commit_reply(
        grpc_framing.with_tensor(reply, grpc_framing.COMMIT_REPLY_FIELD, dtype, [THETA.size], data)
    )
    grpc_framing.announce(reply.parameters, dtype, THETA.size)
    server.sendall(frame_start(Op.COMMIT | REPLY, reply.SerializeToString(), len(data)) + data)
    connection.send(Op.COMMIT, b"")
    committed = read_committed(connection)
    assert not connection.awaiting and not connection.closed
    np.testing.assert_array_equal(committed.parameters, unary.parameters)
    assert committed.parameters is not None
    assert committed.parameters.dtype == np.float32 and not committed.parameters.flags.writeable
    assert committed.buffers is not None and unary.buffers is not None
    np.testing.assert_array_equal(committed.buffers.floats, unary.buffers.floats)
    assert committed.buffers.integers.tolist() == unary.buffers.integers.tolist() == [2**40]
    figures = ("version", "staleness", "scaling_mean", "scaling_median", "scaling_at_zero", "scaling_at_max")
    assert [getattr(committed, f) for f in figures] == [getattr(unary, f) for f in figures]


def test_an_unchanged_pull_carries_no_theta(pair: tuple[DataConnection, socket.socket]) -> None:
    connection, server = pair
    reply = pb.PullResponse(version=9, unchanged=True, history="h")
    server.sendall(frame_start(Op.PULL | REPLY, reply.SerializeToString()))
    connection.send(Op.PULL, b"")
    pulled = read_pulled(connection)
    assert (pulled.version, pulled.parameters, pulled.buffers, pulled.history) == (9, None, None, "h")


def test_an_unchanged_commit_reply_carries_no_theta(pair: tuple[DataConnection, socket.socket]) -> None:
    connection, server = pair
    reply = commit_response()
    reply.unchanged, reply.round_pending = True, 3
    server.sendall(frame_start(Op.COMMIT | REPLY, reply.SerializeToString()))
    connection.send(Op.COMMIT, b"")
    committed = read_committed(connection)
    assert (committed.parameters, committed.round_pending) == (None, 3) and not connection.awaiting


@pytest.mark.parametrize("op", [Op.COMMIT, Op.PULL])
def test_an_unchanged_reply_with_bytes_after_it_is_a_protocol_error(
    pair: tuple[DataConnection, socket.socket], op: Op
) -> None:
    connection, server = pair
    reply = (
        pb.CommitResponse(version=3, unchanged=True) if op is Op.COMMIT else pb.PullResponse(version=3, unchanged=True)
    )
    server.sendall(frame_start(op | REPLY, reply.SerializeToString(), 8) + bytes(8))
    connection.send(op, b"")
    with pytest.raises(errors.GempsError, match="an unchanged reply with 8 bytes of payload") as raised:
        (read_committed if op is Op.COMMIT else read_pulled)(connection)
    assert not errors.worth_another_attempt(raised.value) and connection.closed


def test_a_refusal_is_the_error_grpc_would_raise(pair: tuple[DataConnection, socket.socket]) -> None:
    connection, server = pair
    refusal = pb.DataPlaneError(
        code=grpc.StatusCode.NOT_FOUND.value[0], message="unknown worker", reason="unknown_worker"
    )
    server.sendall(frame_start(Op.ERROR, refusal.SerializeToString()))
    connection.send(Op.COMMIT, b"")
    with pytest.raises(errors.WorkerNotFoundError) as raised:
        read_committed(connection)
    same = errors.from_status(grpc.StatusCode.NOT_FOUND, "unknown worker", "unknown_worker")
    assert (raised.value.message, raised.value.code, raised.value.reason) == (same.message, same.code, same.reason)
    assert raised.value.reason == Reason.UNKNOWN_WORKER and errors.server_forgot_worker(raised.value)
    assert connection.closed  # the server may close it after a refusal: never reused
    assert type(errors.from_status_number(99, "odd")) is errors.GempsError


def test_a_connection_lost_mid_reply_is_retried_as_unavailable(pair: tuple[DataConnection, socket.socket]) -> None:
    connection, server = pair
    reply = commit_response()
    grpc_framing.announce(reply.parameters, FLOAT32, THETA.size)
    server.sendall(frame_start(Op.COMMIT | REPLY, reply.SerializeToString(), THETA.nbytes) + THETA.tobytes()[:100])
    connection.send(Op.COMMIT, b"")
    server.recv(20, socket.MSG_WAITALL)  # read: a peer closing with bytes unread resets instead
    server.close()
    with pytest.raises(errors.ServerUnavailableError, match="closed by the server after 100 of 4000 bytes"):
        read_committed(connection)
    assert connection.closed and errors.worth_another_attempt(errors.ServerUnavailableError("x"))


def test_a_reply_of_another_size_than_announced_is_a_protocol_error(pair: tuple[DataConnection, socket.socket]) -> None:
    connection, server = pair
    reply = commit_response()
    grpc_framing.announce(reply.parameters, FLOAT32, THETA.size)
    server.sendall(frame_start(Op.COMMIT | REPLY, reply.SerializeToString(), 12))
    connection.send(Op.COMMIT, b"")
    with pytest.raises(errors.GempsError, match="12 bytes of payload; the header announced 4000") as raised:
        read_committed(connection)
    assert not errors.worth_another_attempt(raised.value) and connection.closed


@pytest.mark.parametrize(("ticket", "address"), [(b"x" * 32, "test"), (b"t" * 32, "tcp:1")])
def test_a_server_that_does_not_prove_the_ticket_gets_nothing_more(ticket: bytes, address: str) -> None:
    """A made-up ticket, or the right one's proof for another address (a relay): ServerNotProven,
    the connection closed after the CHALLENGE (no HELLO, no proof, no byte of the ticket)."""
    client, server = socket.socketpair()
    client.settimeout(5)
    connection = DataConnection(client, "local socket gemps-data-1-ab", "test")
    answering = threading.Thread(target=_answer_once, args=(server, ticket, address))
    answering.start()
    with pytest.raises(ServerNotProven, match=r"data plane at local socket gemps-data-1-ab: .*did not prove") as raised:
        connection.hello("w1", b"t" * 32)
    answering.join(5)
    assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED and not errors.worth_another_attempt(raised.value)
    assert connection.closed
    received = b""
    while chunk := server.recv(4096):
        received += chunk
    server.close()
    assert received == b"" and b"t" * 32 not in received  # nothing after the CHALLENGE


def _answer_once(sock: socket.socket, ticket: bytes, address: str) -> None:
    """Read the CHALLENGE and answer it with `ticket` at `address`; nothing more."""
    protocol = ServerConnection(1 << 16)
    while protocol.next_event() is NEED_DATA:
        protocol.received(sock.recv_into(protocol.read_view()))
    sock.sendall(protocol.send(Answer(ticket, address)))


def test_a_large_frame_goes_out_whole_from_the_callers_memory(pair: tuple[DataConnection, socket.socket]) -> None:
    """Partial sendmsg calls (the socket buffer is far smaller) resume where they stopped."""
    connection, server = pair
    payload = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)  # 8 MB
    received = bytearray()

    def read_all() -> None:
        while chunk := server.recv(1 << 20):
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    connection.send(Op.COMMIT, b"header", wire_view(payload))
    connection.sock.shutdown(socket.SHUT_WR)
    reader.join(10)
    preamble = read_preamble(received)
    assert (preamble.op, preamble.header_bytes, preamble.payload_bytes) == (Op.COMMIT, 6, payload.nbytes)
    assert received[20:26] == b"header" and bytes(received[26:]) == payload.tobytes()
    assert connection.awaiting


# -- where, and which plane ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "host"),
    [("127.0.0.1:50051", "127.0.0.1"), ("[::1]:50051", "::1"), ("dns:///gemps.svc:50051", "gemps.svc"), ("h", "h")],
)
def test_the_data_plane_is_on_the_host_grpc_reached(target: str, host: str) -> None:
    assert target_host(target) == host


def test_the_plane_is_checked_and_comes_from_the_environment() -> None:
    assert resolve_plane(None, {}) == "auto"
    assert resolve_plane(None, {"GEMPS_PLANE": "grpc"}) == "grpc"
    assert resolve_plane("data", {"GEMPS_PLANE": "grpc"}) == "data"  # the argument wins
    with pytest.raises(ValueError, match="GEMPS_PLANE must be one of auto, data, grpc, not 'tcp'"):
        resolve_plane(None, {"GEMPS_PLANE": "tcp"})
    with pytest.raises(ValueError, match="plane must be one of auto, data, grpc, not 'udp'"):
        Client("127.0.0.1:1", plane="udp")
    client = Client("127.0.0.1:1", plane="grpc")
    assert client.plane == "grpc" and client.planes == ["grpc"]
    client.close()


# -- a transport pushed to gRPC comes back ---------------------------------------------------------


def test_a_transport_that_fell_back_tries_the_data_plane_again_with_a_bounded_jittered_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waits of 1, 2, 4 ... s, at most 60, each ±25 % (here the longest, then the shortest); no
    attempt before its time; a success is a return, and the next fallback starts again at 1 s."""
    clock = [1000.0]
    monkeypatch.setattr(data_plane_transport, "_now", lambda: clock[0])
    monkeypatch.setattr(random, "random", lambda: 1.0)
    # Nothing listens there: each attempt is refused at once. From the suite's band: a port the kernel
    # chose could be given to another test's listener before this one binds it again below.
    port = free_port()
    grpc_transport = GrpcTransport(
        "127.0.0.1:1", ChannelSecurity(), max_message_bytes=1 << 20, timeout=5, wire_dtype=FLOAT32, chunk_bytes=1 << 20
    )
    transport = DataPlaneTransport(grpc_transport, ChannelSecurity(), shared_memory=False)
    transport._offer, transport._worker_id = DataPlane(port=port, ticket=b"t" * 32), "w1"
    transport._unusable("127.0.0.1:1", "a fault")  # as a refused connection does
    waits = []
    for _ in range(8):
        assert transport.fell_back and transport.plane == "grpc" and transport._retry_at is not None
        waits.append(round(transport._retry_at - clock[0], 3))
        retry_at = transport._retry_at
        clock[0] = retry_at - 0.001
        assert transport._ready("w1") is None and transport._retry_at == retry_at  # not yet: no attempt
        clock[0] = retry_at
        assert transport._ready("w1") is None  # attempted, refused: gRPC, and a longer wait
    assert waits == [1.25, 2.5, 5.0, 10.0, 20.0, 40.0, 75.0, 75.0]  # doubling, at most 60 s, +25 % here
    monkeypatch.setattr(random, "random", lambda: 0.0)
    with socket.create_server(("127.0.0.1", port)) as server:  # the data plane is back
        answering = threading.Thread(target=_answer_hello, args=(server,))
        answering.start()
        clock[0] = transport._retry_at or 0.0
        connection = transport._ready("w1")
        assert connection is not None and transport.plane == "data" and transport.returns == 1
        transport._drop()
        answering.join(5)
    transport._unusable("127.0.0.1:1", "another fault")
    assert transport._retry_at == clock[0] + 0.75  # from 1 s again, -25 %
    transport.close()


def _answer_hello(server: socket.socket) -> None:
    sock, _address = server.accept()
    with sock:
        answer_handshake(sock, b"t" * 32, f"tcp:{server.getsockname()[1]}")
        sock.recv(1)  # until the client closes


# -- the transport's states: one enum, one transition function ------------------------------------


class FakeConnection(DataConnection):
    """A connection past its HELLO on a socket pair; `attach` succeeds or is refused."""

    def __init__(self, *, local: bool = False, refuse_attach: bool = False) -> None:
        sock, self.peer = socket.socketpair()
        super().__init__(sock, "fake", "fake")
        self.local, self.refuse_attach, self.attached = local, refuse_attach, 0

    def attach(self, size: int) -> None:
        self.attached += 1
        if self.refuse_attach:
            self.close()  # as the server does after refusing an ATTACH
            raise errors.InvalidArgumentError("shared memory is attached already", errors.InvalidArgumentError.code)

    def close(self) -> None:
        super().close()
        self.peer.close()


def offered_transport(monkeypatch: pytest.MonkeyPatch, *opened: FakeConnection) -> DataPlaneTransport:
    """A transport whose registration offered a data plane; each connection it opens is the next
    of `opened`."""
    grpc_transport = GrpcTransport(
        "127.0.0.1:1", ChannelSecurity(), max_message_bytes=1 << 20, timeout=5, wire_dtype=FLOAT32, chunk_bytes=1 << 20
    )
    transport = DataPlaneTransport(grpc_transport, ChannelSecurity())
    connections = iter(opened)
    monkeypatch.setattr(transport, "_open", lambda offer, timeout=None: next(connections))
    transport._offer, transport._worker_id = DataPlane(port=1, ticket=b"t" * 32), "w1"
    transport._become(data_plane_link.Link.OFFERED)
    return transport


def test_the_states_a_transport_moves_through(monkeypatch: pytest.MonkeyPatch) -> None:
    Link = data_plane_link.Link
    first, second = FakeConnection(), FakeConnection()
    transport = offered_transport(monkeypatch, first, second)
    assert (transport.state, transport.plane) == (Link.OFFERED, "data")
    assert transport._ready("w1") is first and transport.state is Link.CONNECTED
    assert transport._ready("") is None  # a read-only pull: no registration, gRPC
    first.close()  # broke: the next call opens another
    assert transport._ready("w1") is second and transport.state is Link.CONNECTED
    monkeypatch.setattr(transport.grpc, "leave", lambda worker_id: None)  # no gRPC server here
    transport.leave("w1")
    assert second.closed and transport.plane == "grpc" and transport._ready("w1") is None
    assert transport.state is Link.NOT_OFFERED  # type: ignore[comparison-overlap]  # leave() moved it
    transport.close()
    assert transport.state is Link.CLOSED
    with pytest.raises(RuntimeError, match="closed -> offered"):
        transport._become(Link.OFFERED)


def test_shared_memory_is_a_state_of_its_own_and_a_refusal_costs_one_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Link = data_plane_link.Link
    local = FakeConnection(local=True)
    transport = offered_transport(monkeypatch, local)
    assert transport._ready("w1", 40) is local and transport.state is Link.SHARED and transport.shared
    assert transport._ready("w1", 40) is local and local.attached == 1  # attached once
    refusing, plain = FakeConnection(local=True, refuse_attach=True), FakeConnection(local=True)
    transport = offered_transport(monkeypatch, refusing, plain)
    assert transport._ready("w1", 40) is plain and transport.state is Link.CONNECTED  # without, from now on
    assert refusing.closed and not transport._attach_memory and plain.attached == 0
    transport.close()


def test_only_the_moves_listed_are_made(monkeypatch: pytest.MonkeyPatch) -> None:
    Link = data_plane_link.Link
    assert all(Link.CLOSED in moves for state, moves in data_plane_link.MOVES.items() if state is not Link.CLOSED)
    assert not data_plane_link.MOVES[Link.CLOSED]
    transport = offered_transport(monkeypatch, FakeConnection())
    with pytest.raises(RuntimeError, match="offered -> shared"):
        transport._become(Link.SHARED)  # memory is attached to a connection, never to none
    transport._unusable("here", "a fault")
    assert transport.state is Link.FELL_BACK and transport._retry_at is not None and transport.plane == "grpc"
    with pytest.raises(RuntimeError, match="fell back -> offered"):
        transport._become(Link.OFFERED)  # only a successful return leaves a fallback
    transport.close()
