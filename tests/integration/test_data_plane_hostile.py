"""The data plane's framing against hostile input (DESIGN §3b): truncated and lying frames, bad
preambles, garbage, too many connections, slow senders and readers, clients killed mid-frame.
Each is refused and counted, and afterwards nothing is held: the server's threads are back to
where they were, and an honest client still commits."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from gemps_proto import data_plane_frames
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.data_plane_frames import VERSION as V
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.data_plane_client import DataPlaneClient, Frame, commit_header
from tests.helpers import InProcessServer, scrape_series, wait_for
from tests.integration.conftest import StartServer, open_stub
from tests.integration.test_data_plane import connected, register

P = 1000
MAX_CONNECTIONS = 4
QUICK = {
    "handshake_timeout": 0.5,
    "data_plane_hello_timeout": 0.5,
    "connection_idle_timeout": 2.0,
    "stream_idle_timeout": 0.5,
    "max_data_connections": MAX_CONNECTIONS,
    "data_plane_buffers": 1,
    "max_message_mb": 1,
}


@pytest.fixture
def server(start_server: StartServer) -> InProcessServer:
    return start_server(rule="downpour", **QUICK)


def refusals(server: InProcessServer) -> dict[str, float]:
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    prefix = 'gemps_data_plane_refusals_total{reason="'
    return {name[len(prefix) : -2]: value for name, value in series.items() if name.startswith(prefix)}


def settled(server: InProcessServer, baseline: int) -> None:
    """Nothing held: no data-plane connection open, the process's threads back to `baseline`, and
    an honest client's commit goes through."""
    assert server.server.data_plane is not None
    wait_for(lambda: server.server.data_plane.connections == 0, timeout=10, what="connections closed")  # type: ignore[union-attr]
    wait_for(lambda: threading.active_count() <= baseline, timeout=10, what="threads back to baseline")
    reply = register(open_stub(server.target))
    with connected(reply) as client:
        assert client.commit(reply.worker_id, np.zeros(P, np.float32), reply.version).op == Op.COMMIT | REPLY


def baseline_threads(server: InProcessServer) -> int:
    register(open_stub(server.target))  # gRPC's own threads started
    time.sleep(0.1)
    return threading.active_count()


def raw(server: InProcessServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server.data_port), timeout=5)


def closed(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, TimeoutError):
        pass
    return True


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not a frame at all
        struct.pack("<4sBBHIQ", b"GMDQ", V, Op.CHALLENGE, 0, 10, 0),  # bad magic
        struct.pack("<4sBBHIQ", b"GMDP", 9, Op.CHALLENGE, 0, 10, 0),  # bad version
        struct.pack("<4sBBHIQ", b"GMDP", 1, Op.HELLO, 0, 10, 0),  # a version 1 client (its HELLO carried the ticket)
        struct.pack("<4sBBHIQ", b"GMDP", V, 0x55, 0, 10, 0),  # unknown op
        struct.pack("<4sBBHIQ", b"GMDP", V, Op.COMMIT, 0, 10, 0),  # a request before the HELLO
        struct.pack("<4sBBHIQ", b"GMDP", V, Op.HELLO, 0, 10, 0),  # a HELLO before the CHALLENGE
        struct.pack("<4sBBHIQ", b"GMDP", V, Op.CHALLENGE, 0, 1 << 30, 0),  # a CHALLENGE announcing 1 GiB
        struct.pack("<4sBBHIQ", b"GMDP", V, Op.CHALLENGE, 0, 10, 1 << 40),  # a CHALLENGE with a payload
        struct.pack("<4sBBHIQ", b"GMDP", V, Op.CHALLENGE, 0, 5, 0) + b"\xff" * 5,  # a CHALLENGE that does not parse
    ],
)
def test_garbage_instead_of_a_hello_is_refused_and_closed(server: InProcessServer, garbage: bytes) -> None:
    baseline = baseline_threads(server)
    with raw(server) as sock:
        sock.sendall(garbage)
        assert closed(sock)
    counted = refusals(server)
    assert counted["bad_hello"] + counted["unknown_worker"] == 1
    settled(server, baseline)


def test_truncated_frames_and_a_silent_client_time_out(server: InProcessServer) -> None:
    baseline = baseline_threads(server)
    with raw(server) as silent, raw(server) as truncated:
        truncated.sendall(data_plane_frames.frame_start(Op.CHALLENGE, b"\x0a\x01")[:-1])  # one byte short
        assert closed(silent) and closed(truncated)  # after --handshake-timeout
    assert refusals(server)["handshake_timeout"] == 2
    reply = register(open_stub(server.target))
    with connected(reply) as client:  # a request cut short after a good hello
        client.sock.sendall(data_plane_frames.frame_start(Op.COMMIT, commit_header(reply.worker_id, P, 0), 4 * P)[:30])
        frame = client.receive()  # DEADLINE_EXCEEDED after --stream-idle-timeout, then closed
        assert frame.error is not None and frame.error.reason == "stream_idle"
        assert client.closed_by_server()
    assert refusals(server)["stream_timeout"] == 1
    settled(server, baseline)


def test_an_idle_connection_is_closed_after_the_idle_timeout(server: InProcessServer) -> None:
    baseline = baseline_threads(server)
    reply = register(open_stub(server.target))
    with connected(reply) as client:
        started = time.monotonic()
        assert client.closed_by_server()  # after --connection-idle-timeout (2 s here)
        assert time.monotonic() - started >= 1.5
    assert refusals(server)["idle_timeout"] == 1
    settled(server, baseline)


def test_oversized_header_and_lying_payload_lengths_are_refused_unread(server: InProcessServer) -> None:
    baseline = baseline_threads(server)
    reply = register(open_stub(server.target))
    cases = [
        data_plane_frames.Preamble(Op.COMMIT, 2 << 20, 0).pack(),  # header past --max-message-mb (1)
        data_plane_frames.frame_start(Op.COMMIT, commit_header(reply.worker_id, P, 0), 1 << 40),  # 1 TiB payload
        data_plane_frames.frame_start(Op.PULL, pb.PullRequest(worker_id=reply.worker_id).SerializeToString(), 8),
        data_plane_frames.frame_start(Op.COMMIT, b"\xff\xff\xff", 4 * P),  # a header that does not parse
        data_plane_frames.frame_start(Op.HELLO, b""),  # a second HELLO
        data_plane_frames.frame_start(Op.COMMIT | REPLY, b""),  # a reply from the client
    ]
    for frame_bytes in cases:
        with connected(reply) as client:
            client.sock.sendall(frame_bytes)
            frame = client.receive()
            assert frame.op == Op.ERROR, frame_bytes[:24]
            assert client.closed_by_server()
    assert server.server.state.core.version == 0
    counted = refusals(server)
    assert counted["refused_unread"] == 4 and counted["bad_frame"] == 2
    settled(server, baseline)


def test_connections_past_the_limit_are_refused(server: InProcessServer) -> None:
    baseline = baseline_threads(server)
    reply = register(open_stub(server.target))
    held = [connected(reply) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = DataPlaneClient(server.server.data_port)
        frame = extra.receive()
        assert frame.error is not None and frame.error.code == 8  # RESOURCE_EXHAUSTED
        assert extra.closed_by_server()
        extra.close()
        assert refusals(server)["too_many_connections"] == 1
        assert held[0].commit(reply.worker_id, np.zeros(P, np.float32), 0).op == Op.COMMIT | REPLY
    finally:
        for client in held:
            client.close()
    settled(server, baseline)


def test_a_slow_sender_is_closed_after_the_stream_timeout(server: InProcessServer) -> None:
    baseline = baseline_threads(server)
    reply = register(open_stub(server.target))
    start = data_plane_frames.frame_start(Op.COMMIT, commit_header(reply.worker_id, P, 0), 4 * P)
    with connected(reply) as client:
        client.sock.sendall(start + b"\0" * 100)  # then nothing more: the payload trickles to a halt
        frame = client.receive()
        assert frame.error is not None and frame.error.reason == "stream_idle"
        assert client.closed_by_server()
    with connected(reply) as client:  # a byte every 0.3 s beats the 0.5 s stall timeout, not the rate
        client.sock.sendall(start)
        answer: Frame | None = None
        for _ in range(20):
            try:
                client.sock.sendall(b"\0")
            except OSError:
                break
            client.sock.settimeout(0.3)
            try:
                answer = client.receive()
                break
            except TimeoutError:
                continue
        assert answer is not None and answer.error is not None and answer.error.reason == "stream_idle"
    assert refusals(server)["stream_timeout"] == 2
    assert server.server.state.core.version == 0
    settled(server, baseline)


def test_a_slow_reader_gives_its_buffer_back(start_server: StartServer) -> None:
    """A client that never reads its (large) reply: the server's send stalls, gives up after
    --stream-idle-timeout, and the only pooled buffer serves the next client."""
    big = 4_000_000
    server = start_server(rule="downpour", **{**QUICK, "max_message_mb": 64})
    stub = open_stub(server.target, max_message_mb=64)
    spec = [pb.ParameterSpec(name="w", shape=[big], dtype=pb.DTYPE_FLOAT32)]
    reply = stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(big, np.float32))))
    time.sleep(0.1)
    baseline = threading.active_count()
    reader = DataPlaneClient(reply.data_plane.port)
    reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    assert reader.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
    payload = np.zeros(big, np.float32).tobytes()
    reader.send(Op.COMMIT, commit_header(reply.worker_id, big, 0), payload)  # and never reads the reply
    wait_for(lambda: refusals(server)["stream_timeout"] == 1, timeout=20, what="the stalled reply given up")
    other = stub.Register(pb.RegisterRequest(spec=spec))
    with connected(other) as client:
        frame = client.commit(other.worker_id, np.zeros(big, np.float32), 1)
        assert frame.op == Op.COMMIT | REPLY and len(frame.payload) == 4 * big
    reader.close()
    settled_big(server, baseline)


def settled_big(server: InProcessServer, baseline: int) -> None:
    assert server.server.data_plane is not None
    wait_for(lambda: server.server.data_plane.connections == 0, timeout=10, what="connections closed")  # type: ignore[union-attr]
    wait_for(lambda: threading.active_count() <= baseline, timeout=10, what="threads back to baseline")


def test_a_client_killed_mid_frame_leaves_nothing(server: InProcessServer) -> None:
    baseline = baseline_threads(server)
    reply = register(open_stub(server.target))
    for cut in (5, 40, 2000):
        client = connected(reply)
        whole = data_plane_frames.frame_start(Op.COMMIT, commit_header(reply.worker_id, P, 0), 4 * P) + bytes(4 * P)
        client.sock.sendall(whole[:cut])
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        client.close()
    assert server.server.state.core.version == 0
    settled(server, baseline)
