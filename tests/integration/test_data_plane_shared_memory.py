"""The data plane on the server's host (DESIGN §3c, gemps_proto/data_plane_frames.py): a Unix socket
beside the TCP port where a client attaches shared memory, so θ's bytes cross no socket. What a
worker gets is what TCP and gRPC give, bit for bit; and against hostile input (DESIGN §3b) a
descriptor that is not one sealed memfd of θ's size is refused and closed, a descriptor passed
with any other frame likewise, and a client scribbling on its memory while the server reads it
cannot put a value into θ that the checks did not see."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import gemps
from gemps.data_plane_transport import DataPlaneTransport
from gemps_proto import data_plane_frames
from gemps_proto.data_plane_frames import REPLY, SHARED, Op
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.data_plane_client import DataPlaneClient, commit_header, theta_of
from tests.helpers import InProcessServer, wait_for
from tests.integration.conftest import StartServer, open_stub
from tests.integration.test_data_plane import P, gradients, grpc_theta, register
from tests.integration.test_data_plane_hostile import refusals

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd, seals and abstract sockets are Linux's")

SIZE = 4 * P  # θ's float32 bytes: what shared memory must hold


@pytest.fixture
def server(start_server: StartServer) -> InProcessServer:
    return start_server(rule="downpour", learning_rate=0.1, stream_idle_timeout=1.0)


def memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    fd = os.memfd_create("test-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # written by its client first: the server maps no other
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def temporary_file() -> int:
    handle, path = tempfile.mkstemp()
    os.unlink(path)
    return handle


def local(reply: pb.RegisterResponse) -> DataPlaneClient:
    """A local data-plane connection of the registration `reply`, its HELLO answered."""
    assert reply.data_plane.local_socket
    client = DataPlaneClient(0, local_socket=reply.data_plane.local_socket)
    answer = client.hello(reply.worker_id, reply.data_plane.ticket)
    assert answer.op == Op.HELLO | REPLY, answer.error
    return client


def passed_fds() -> int:
    """Descriptors of this process open on the tests' memfds and temporary files: the tests close
    their own copies, so what is left is the server's (this process)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        count += "memfd:test-shared" in target or "/tmp" in target
    return count


def test_the_sdk_commits_through_shared_memory_bit_for_bit_as_over_tcp_and_grpc(start_server: StartServer) -> None:
    steps = gradients(5)
    theta = {}
    for route in ("shared", "tcp", "grpc"):
        server = start_server(rule="gem", learning_rate=0.1)
        plane = "grpc" if route == "grpc" else "data"
        with gemps.Client(server.target, plane=plane, shared_memory=route == "shared") as client:
            client.register({"w": np.linspace(-1, 1, P, dtype=np.float32)})
            for gradient in steps:
                result = client.commit(gradient)
            transport = client._router.sessions[0].transport
            if route != "grpc":
                assert isinstance(transport, DataPlaneTransport) and transport.shared == (route == "shared")
            pulled = client.pull()
            assert pulled.version == 5
            np.testing.assert_array_equal(pulled.flat, result.parameters.flat)
            theta[route] = np.array(result.parameters.flat)
    np.testing.assert_array_equal(theta["shared"], theta["tcp"])
    np.testing.assert_array_equal(theta["shared"], theta["grpc"])


def test_shared_memory_off_offers_no_local_socket_and_the_sdk_uses_tcp(start_server: StartServer) -> None:
    server = start_server(rule="downpour", shared_memory="off")
    assert register(open_stub(server.target)).data_plane.local_socket == ""
    with gemps.Client(server.target, plane="data") as client:
        client.register({"w": np.zeros(P, np.float32)})
        assert client.commit(np.ones(P, np.float32)).version == 1
        transport = client._router.sessions[0].transport
        assert isinstance(transport, DataPlaneTransport) and not transport.shared


def test_a_raw_client_attaches_commits_and_pulls_through_its_memory(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    reply = register(stub)
    fd = memfd(SIZE)
    shared = mmap.mmap(fd, SIZE)
    with local(reply) as client:
        assert client.attach([fd], SIZE).op == Op.ATTACH | REPLY
        os.close(fd)
        gradient = np.full(P, 0.5, np.float32)
        shared[:SIZE] = gradient.tobytes()
        client.send(Op.COMMIT, commit_header(reply.worker_id, P, 0), payload_bytes=SIZE, flags=SHARED)
        frame = client.receive(memoryview(shared))
        version, theta = grpc_theta(stub)
        assert version == 1
        np.testing.assert_array_equal(theta_of(frame), theta)  # θ after the commit, in the shared memory
        client.send(Op.PULL, pb.PullRequest(worker_id=reply.worker_id).SerializeToString(), flags=SHARED)
        np.testing.assert_array_equal(theta_of(client.receive(memoryview(shared))), theta)
    shared.close()


@pytest.mark.parametrize(
    "case",
    ["no descriptor", "two descriptors", "not sealed", "not a memfd", "wrong size", "announced wrongly", "twice"],
)
def test_shared_memory_that_is_not_one_sealed_memfd_of_thetas_size_is_refused(
    server: InProcessServer, case: str
) -> None:
    reply = register(open_stub(server.target))
    baseline = passed_fds()
    fds: list[int] = {
        "no descriptor": lambda: [],
        "two descriptors": lambda: [memfd(SIZE), memfd(SIZE)],
        "not sealed": lambda: [memfd(SIZE, seals=0)],
        "not a memfd": lambda: [temporary_file()],
        "wrong size": lambda: [memfd(SIZE + 4096)],
        "announced wrongly": lambda: [memfd(SIZE)],
        "twice": lambda: [memfd(SIZE)],
    }[case]()
    if case == "not a memfd":
        os.ftruncate(fds[0], SIZE)
    announced = SIZE * 2 if case == "announced wrongly" else SIZE
    with local(reply) as client:
        if case == "twice":
            first = memfd(SIZE)
            assert client.attach([first], SIZE).op == Op.ATTACH | REPLY
            os.close(first)
        if case == "two descriptors":  # more than the server takes: closed as they come (issue 42)
            with pytest.raises(ConnectionError):
                client.attach(fds, announced)
        else:
            frame = client.attach(fds, announced)
            assert frame.op == Op.ERROR and frame.error is not None and frame.error.reason == "malformed", case
            assert client.closed_by_server()
    for fd in fds:
        os.close(fd)
    assert refusals(server)["descriptors" if case == "two descriptors" else "bad_attach"] == 1
    # Nothing held: every descriptor the server was passed is closed (this process is the server's).
    wait_for(lambda: passed_fds() <= baseline, timeout=10, what="descriptors closed")
    honest = memfd(SIZE)
    with local(register(open_stub(server.target))) as client:  # an honest one still attaches
        assert client.attach([honest], SIZE).op == Op.ATTACH | REPLY
    os.close(honest)


def test_descriptors_with_any_other_frame_and_shared_frames_without_memory_are_refused(
    server: InProcessServer,
) -> None:
    stub = open_stub(server.target)
    reply = register(stub)
    baseline = passed_fds()
    fd = memfd(SIZE)
    with local(reply) as client:  # a descriptor slipped in with a commit
        client.send(Op.COMMIT, commit_header(reply.worker_id, P, 0), bytes(SIZE), fds=[fd])
        frame = client.receive()
        assert frame.op == Op.ERROR and frame.error is not None and frame.error.reason == "malformed"
        assert client.closed_by_server()
    os.close(fd)
    with local(reply) as client:  # SHARED before anything is attached
        client.send(Op.COMMIT, commit_header(reply.worker_id, P, 0), payload_bytes=SIZE, flags=SHARED)
        assert client.receive().op == Op.ERROR and client.closed_by_server()
    fd = memfd(SIZE)
    challenge = pb.DataPlaneChallenge(worker_id=reply.worker_id, nonce=b"n" * 32)
    hello = data_plane_frames.frame_start(Op.CHALLENGE, challenge.SerializeToString())
    with DataPlaneClient(0, local_socket=reply.data_plane.local_socket) as client:  # one with the handshake
        socket.send_fds(client.sock, [hello], [fd])
        with pytest.raises(ConnectionError):  # before a ticket is proven: closed at once (issue 42)
            client.receive()
    os.close(fd)
    with DataPlaneClient(reply.data_plane.port) as client:  # an ATTACH on TCP: no descriptor can come
        assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
        frame = client.attach([], SIZE)
        assert frame.op == Op.ERROR and client.closed_by_server()
    counted = refusals(server)
    assert counted["refused_unread"] == 2 and counted["descriptors"] == 1 and counted["bad_attach"] == 1
    assert server.server.state.core.version == 0
    wait_for(lambda: passed_fds() <= baseline, timeout=10, what="descriptors closed")


# Writes NaN, infinity, a huge value and a small one over the whole memory, in turn, as fast as it
# can: a process of its own, so it runs while the server reads (no GIL between them).
SCRIBBLER = """
import mmap, sys
import numpy as np
fd, size = int(sys.argv[1]), int(sys.argv[2])
values = np.frombuffer(mmap.mmap(fd, size), np.float32)
poison = np.array([np.nan, np.inf, 3e38, 1e-3], np.float32)
values.fill(np.nan)
print("scribbling", flush=True)  # the test commits only once poison is in the memory
while True:
    for value in poison:
        values.fill(value)
"""


def test_a_client_scribbling_on_its_memory_cannot_put_an_unchecked_value_into_theta(server: InProcessServer) -> None:
    """The payload is checked where it lies, then GEM's pass reads each value once, held to the
    peak the check found (or it is copied out first, for a rule that cannot hold it): a client that
    keeps writing NaN and huge values there while the server reads gets each commit applied with
    values within what passed the checks, or refused; θ stays finite."""
    size = 1_000_000
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="w", shape=[size], dtype=pb.DTYPE_FLOAT32)]
    reply = stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(size, np.float32))))
    fd = memfd(4 * size)
    with local(reply) as client:
        # It maps the memory before ATTACH (the server then seals it against new writable mappings).
        scribbler = subprocess.Popen(
            [sys.executable, "-c", SCRIBBLER, str(fd), str(4 * size)], pass_fds=[fd], stdout=subprocess.PIPE, text=True
        )
        outcomes: list[str] = []
        try:
            assert scribbler.stdout is not None and scribbler.stdout.readline() == "scribbling\n"
            assert client.attach([fd], 4 * size).op == Op.ATTACH | REPLY
            # Bounded, and long enough to see poison: about half of the scribbler's time is NaN or inf.
            while len(outcomes) < 1000 and (len(outcomes) < 100 or "non_finite" not in outcomes):
                client.send(Op.COMMIT, commit_header(reply.worker_id, size, 0), payload_bytes=4 * size, flags=SHARED)
                frame = client.receive(memoryview(bytearray(4 * size)))
                outcomes.append("applied" if frame.error is None else frame.error.reason)
        finally:
            scribbler.kill()
            scribbler.wait()
            os.close(fd)
    theta = np.frombuffer(stub.Pull(pb.PullRequest(known_version=-1)).parameters.data, np.float32)
    assert np.isfinite(theta).all()
    assert set(outcomes) <= {"applied", "non_finite"} and "non_finite" in outcomes  # poison seen, refused


def test_requests_are_applied_in_the_order_they_arrived(start_server: StartServer) -> None:
    """The data plane's FIFO, directly (the SDK-thread tests in test_fifo.py cannot see it on two
    cores): while the server applies a large commit, eight clients' requests arrive one after
    another, each in one piece; they are applied in that order, round after round."""
    size = 2_000_000
    server = start_server(rule="downpour", max_message_mb=16)
    stub = open_stub(server.target, max_message_mb=16)
    spec = [pb.ParameterSpec(name="w", shape=[size], dtype=pb.DTYPE_FLOAT32)]
    initial = tensor_to_proto(np.zeros(size, np.float32))
    replies = [stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=initial))]
    replies += [stub.Register(pb.RegisterRequest(spec=spec)) for _ in range(8)]
    clients, memories = [], []
    for reply in replies:
        client = local(reply)
        fd = memfd(4 * size)
        memories.append(mmap.mmap(fd, 4 * size))  # before ATTACH: the server seals it against new writable maps
        assert client.attach([fd], 4 * size).op == Op.ATTACH | REPLY
        os.close(fd)
        clients.append(client)
    try:
        for _round in range(5):
            for client, reply in zip(clients, replies, strict=True):  # the first keeps the server busy
                client.send(Op.COMMIT, commit_header(reply.worker_id, size, 0), payload_bytes=4 * size, flags=SHARED)
            versions = []
            for client, memory in zip(clients, memories, strict=True):
                frame = client.receive(memoryview(memory))
                assert frame.error is None
                versions.append(frame.message(pb.CommitResponse).version)  # type: ignore[attr-defined]
            assert versions == list(range(versions[0], versions[0] + 9)), versions
    finally:
        for client in clients:
            client.close()
        for memory in memories:
            memory.close()
