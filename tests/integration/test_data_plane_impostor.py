"""The SDK authenticates its data-plane server before it trusts it (issue 42, item 1; DESIGN §3c).

A server dies; its abstract Unix socket's name (announced at Register, listed in /proc/net/unix)
and its TCP data port are free. A local user without privileges (uid 65534) binds them and plays
a server that accepts every HELLO and ATTACH and acknowledges every commit with θ = 666 at
versions past 1,000,000 (it speaks the frames with the server's own protocol core). The SDK keeps
committing; the real server comes back a moment later. The impostor must get nothing: no ticket
(nor a proof made with it), no descriptor (so no payload), and no commit of the SDK may come back
acknowledged by it; the SDK says what it refused, and its commits go to the real server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import mmap
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps.data_plane_transport import DataPlaneTransport
from gemps_proto import data_plane_events as events
from gemps_proto.data_plane_frames import Op
from gemps_proto.data_plane_protocol import ServerConnection
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer, free_port, wait_for
from tests.integration.conftest import StartServer, StartServerProcess

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="abstract sockets are Linux's; dropping to uid 65534 needs root",
)

P = 8
NOBODY = 65534
FORGED_VERSION = 1_000_001
FORGED_THETA = 666.0
ROOT = Path(__file__).resolve().parents[2]
FAST_RETRY = gemps.RetryPolicy(max_attempts=60, initial_backoff=0.05, max_backoff=0.25)


# -- the impostor: a child process that drops to uid 65534, then binds the dead server's address --


def _record(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _serve(conn: socket.socket, address: str) -> None:
    """Accept whatever comes, as a server that knows no ticket would: every byte, descriptor and
    event recorded on stdout."""
    protocol = ServerConnection(1 << 20)
    region: mmap.mmap | None = None
    version = FORGED_VERSION
    theta = np.full(P, FORGED_THETA, np.float32).tobytes()
    while True:
        event = protocol.next_event()
        if event is events.NEED_DATA:
            view = protocol.read_view()
            count, ancillary, _flags, _address = conn.recvmsg_into([view], socket.CMSG_SPACE(16 * 4))
            if count == 0:
                return
            fds = [fd for level, kind, data in ancillary if kind == socket.SCM_RIGHTS for fd in _fds(data)]
            _record(received=bytes(view[:count]).hex(), fds=len(fds))
            if fds and region is None:
                region = mmap.mmap(fds[0], 4 * P)
            protocol.received(count)
            continue
        _record(event=type(event).__name__)
        if isinstance(event, events.ProtocolError):
            return
        if isinstance(event, events.ChallengeReceived):  # it knows no ticket: it makes one up
            conn.sendall(protocol.send(events.Answer(secrets.token_bytes(32), address)))
        elif isinstance(event, events.HelloReceived):  # (its core would refuse any proof: not reached)
            _record(hello=event.worker_id)
            conn.sendall(protocol.send(events.Reply(), event.worker_id))
        elif isinstance(event, events.AttachRequested):
            conn.sendall(protocol.send(events.Reply()))
        elif isinstance(event, events.CommitHeader):
            if not event.shared and event.payload_bytes:
                protocol.payload_into(memoryview(bytearray(event.payload_bytes)))
        elif isinstance(event, events.PayloadComplete | events.PullRequested):
            frame = protocol.frame
            assert frame is not None
            header = pb.CommitResponse(version=version) if frame.op == Op.COMMIT else pb.PullResponse(version=version)
            header.parameters.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[P]))
            if frame.shared:
                assert region is not None
                region[: len(theta)] = theta
            start = protocol.send(events.Reply(header.SerializeToString(), len(theta)))
            conn.sendall(start + (b"" if frame.shared else theta))
            _record(acknowledged=version)
            version += 1


def _fds(data: bytes) -> list[int]:
    return list(np.frombuffer(data[: len(data) - len(data) % 4], np.int32))


def impostor_main(kind: str, where: str, address: str) -> None:
    """Drop to uid 65534 (the interpreter is loaded: a user without root could run the same), then
    bind the dead server's abstract name (`kind` local) or TCP port, and serve whoever comes."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if kind == "local":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + where)
    else:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(where)))
    listener.listen(16)
    _record(listening=where, uid=os.getuid())
    while True:
        conn, _peer = listener.accept()
        threading.Thread(target=_serve, args=(conn, address), daemon=True).start()


class Impostor:
    """The impostor's process, as root starts it; `records` what it reported."""

    def __init__(self, kind: str, where: str, address: str) -> None:
        code = f"from {__name__} import impostor_main; impostor_main{(kind, where, address)!r}"
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in PATHS)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, env=environment, cwd=ROOT, text=True
        )
        self.records: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_for(lambda: any("listening" in r for r in self.records), 20, "the impostor listening")
        assert next(r["uid"] for r in self.records if "listening" in r) == NOBODY

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.records.append(json.loads(line))

    def received(self) -> bytes:
        return b"".join(bytes.fromhex(r["received"]) for r in self.records if "received" in r)

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)
        self._reader.join(10)


PATHS = ("proto", "server", "client_sdk", "worker", "cli", "benchmarks", ".")


@pytest.fixture
def impostors() -> Iterator[list[Impostor]]:
    started: list[Impostor] = []
    yield started
    for impostor in started:
        impostor.close()


def transport_of(client: gemps.Client) -> DataPlaneTransport:
    (session,) = client._router.sessions
    assert isinstance(session.transport, DataPlaneTransport)
    return session.transport


def free(name: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect("\0" + name)
    except OSError:
        return True
    finally:
        probe.close()
    return False


@pytest.mark.parametrize("kind", ["local", "tcp"])
def test_an_impostor_on_a_dead_servers_address_gets_nothing_and_acknowledges_nothing(
    kind: str,
    start_server_process: StartServerProcess,
    impostors: list[Impostor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_server_process(rule="downpour", learning_rate=0.1)
    # Each attempt 5 s; the whole call rides out the restart however slow the machine (timeout=).
    client = gemps.Client(server.target, retry=FAST_RETRY, shared_memory=kind == "local", timeout=60, attempt_timeout=5)
    restarted = ServerProcess(port=server.port)
    try:
        client.register({"w": np.zeros(P, np.float32)})
        transport = transport_of(client)
        for _ in range(2):
            client.commit(np.ones(P, np.float32))
        offer = transport._offer
        assert offer is not None and transport.shared == (kind == "local")
        ticket = offer.ticket
        where = offer.local_socket if kind == "local" else str(offer.port)
        address = f"local:{offer.local_socket}" if kind == "local" else f"tcp:{offer.port}"
        server.kill()
        if kind == "local":
            wait_for(lambda: free(offer.local_socket), 10, "the dead server's socket name free")
        impostors.append(impostor := Impostor(kind, where, address))
        restarter = threading.Timer(1.5, restarted.start)
        restarter.start()
        with caplog.at_level(logging.WARNING, logger="gemps.client"):
            results = [client.commit(np.ones(P, np.float32)) for _ in range(10)]
        restarter.join()
        assert any("event" in r for r in impostor.records), "the SDK never went to the impostor"
        received = impostor.received()
        assert ticket not in received, "the impostor received the ticket"
        assert not any(r.get("fds") for r in impostor.records), "the impostor received a descriptor"
        assert not any("hello" in r for r in impostor.records), "the impostor received a HELLO (a proof)"
        assert not any("acknowledged" in r for r in impostor.records), "the impostor answered a commit"
        versions = [r.version for r in results]
        assert max(versions) < FORGED_VERSION
        assert not any((np.asarray(r.parameters.flat) == FORGED_THETA).any() for r in results)
        assert versions == list(range(1, 11))  # the restarted server's (it has no state): each commit once
        assert client.status().commits_applied == 10
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        refused = [w for w in warnings if "did not prove" in w]
        assert refused, warnings
        assert "data plane" in refused[0] and where in refused[0]
    finally:
        client.close()
        restarted.close()


@pytest.mark.parametrize("plane", ["data", "auto"])
def test_another_protocol_on_a_dead_servers_data_port_sends_the_client_back_to_registering(
    plane: str, start_server_process: StartServerProcess
) -> None:
    """Not an impostor: whatever took the dead server's data port since (once, in a full run, a
    neighbour's gRPC server) answers the CHALLENGE in another protocol. That port is no data plane:
    the client asks gRPC, finds the restarted server and registers again with it, even with
    plane="data" (it raised "not a gemps data-plane frame" before, giving up on the call)."""
    server = start_server_process()
    client = gemps.Client(server.target, plane=plane, shared_memory=False, retry=FAST_RETRY, timeout=60)
    squatter = socket.socket()
    restarted = ServerProcess(port=server.port)
    try:
        client.register({"w": np.zeros(P, np.float32)})
        client.commit(np.ones(P, np.float32))
        offer = transport_of(client)._offer
        assert offer is not None
        server.kill()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", offer.port))
        squatter.listen()
        # A gRPC server's first frame: HTTP/2 SETTINGS, 24 bytes of 4 settings after its 9-byte header.
        http2_settings = b"\x00\x00\x18\x04\x00\x00\x00\x00\x00" + bytes(24)

        def answer() -> None:
            with contextlib.suppress(OSError):
                while True:
                    connection, _ = squatter.accept()
                    connection.sendall(http2_settings)

        threading.Thread(target=answer, daemon=True).start()
        restarter = threading.Timer(1.0, restarted.start)
        restarter.start()
        result = client.commit(np.ones(P, np.float32))
        restarter.join()
        assert result.version == 1  # the restarted server's first commit: registered again there
        assert transport_of(client)._offer != offer
    finally:
        client.close()
        squatter.close()
        restarted.close()


class Meter(grpc.ServerInterceptor):
    """Sets `met` when a call reaches the server it intercepts for."""

    def __init__(self, met: threading.Event) -> None:
        self.met = met

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        self.met.set()
        return continuation(details)


@pytest.mark.parametrize("plane", ["grpc", "data"])
def test_another_grpc_service_on_a_dead_servers_port_is_the_server_gone_not_a_refusal(
    plane: str, start_server_process: StartServerProcess
) -> None:
    """The server a client registered with dies and another gRPC service takes its port (in a full
    run, a Ray process did): it answers UNIMPLEMENTED to whatever the client asks - the commit on
    gRPC, the data plane's "is the server up?", registering again. That is the server gone, retried
    until it is back, never a refusal to give up on. The other service stays until the client has
    met it at least once, so the swap's timing cannot decide the outcome."""
    server = start_server_process()
    client = gemps.Client(server.target, plane=plane, shared_memory=False, retry=FAST_RETRY, timeout=60)
    met = threading.Event()
    # No gemps service: every call is UNIMPLEMENTED, after the interceptor has seen it.
    foreign = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2), interceptors=[Meter(met)])
    restarted = ServerProcess(port=server.port)
    try:
        client.register({"w": np.zeros(P, np.float32)})
        client.commit(np.ones(P, np.float32))
        server.kill()
        assert foreign.add_insecure_port(f"127.0.0.1:{server.port}") == server.port
        foreign.start()

        def swap() -> None:  # once met, the other service goes and the gemps server comes back
            met.wait(60)
            foreign.stop(None).wait()
            restarted.start()

        swapper = threading.Thread(target=swap)
        swapper.start()
        result = client.commit(np.ones(P, np.float32))
        swapper.join()
        assert met.is_set()
        assert result.version == 1  # registered again with the restarted server
    finally:
        foreign.stop(None)
        client.close()
        restarted.close()


def partition_one_down(start_server: StartServer) -> tuple[dict[str, Any], InProcessServer, int]:
    """Two partitions on loopback, partition 1 stopped: (their options, partition 0, 1's port)."""
    common: dict[str, Any] = {"partitions": 2, "rule": "downpour", "port": free_port()}
    second = start_server(**common, partition_index=1)
    first = start_server(**{**common, "port": 0}, partition_index=0, partition_addresses=f",:{second.port}")
    second.stop()
    return common, first, second.port


def commit_once_partition_one_is_back(first: InProcessServer, swap: Callable[[], None]) -> int:
    """A new worker registers and commits through `first` while `swap` (on a thread) brings
    partition 1 back once whatever holds its port met the worker; the commit's version."""
    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        with gemps.Client(first.target, plane="grpc", retry=FAST_RETRY, timeout=60) as client:
            client.register({"w": np.zeros(P, np.float32)})
            return client.commit(np.ones(P, np.float32), kind="update").version
    finally:
        swapper.join()


def test_another_grpc_service_where_a_partition_is_announced_is_that_partition_gone(
    start_server: StartServer,
) -> None:
    """A worker that starts (or restarts) while partition 1 is down, another gRPC service on its
    port (in a Ray run, a Ray process took it): the address is partition 0's announcement, not the
    user's, so UNIMPLEMENTED there is partition 1 gone, retried until it is back, even before this
    client ever registered with it (CI met it as a restarted Ray worker's failed registration)."""
    common, first, port = partition_one_down(start_server)
    met = threading.Event()
    foreign = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2), interceptors=[Meter(met)])
    assert foreign.add_insecure_port(f"127.0.0.1:{port}") == port
    foreign.start()

    def swap() -> None:  # once met, the other service goes and partition 1 comes back on its port
        met.wait(60)
        foreign.stop(None).wait()
        start_server(**common, partition_index=1)

    try:
        assert commit_once_partition_one_is_back(first, swap) == 1
        assert met.is_set()
    finally:
        met.set()
        foreign.stop(None)


def test_another_jobs_gemps_server_where_a_partition_is_announced_is_that_partition_gone(
    start_server: StartServer,
) -> None:
    """As above, but what took partition 1's port is another job's gemps server, holding another
    model: it refuses the client's job (FAILED_PRECONDITION, other_job: issue 77; before jobs, the
    slice's spec, spec_mismatch). Partition 0 took the model, so that is not this job's partition:
    gone, retried until it is back (CI met it as a restarted Ray worker's commit refused by
    partition 1's port, reused by another test's server)."""
    common, first, port = partition_one_down(start_server)
    other = start_server(port=port)
    with gemps.Client(other.target) as other_job:
        other_job.register({"x": np.zeros(50, np.float32)})

    def met() -> bool:
        return "reason=other_job" in other.log()

    def swap() -> None:  # once met, the other job's server goes and partition 1 comes back on its port
        wait_for(met, 60, "the other job's server refusing the worker")
        other.stop()
        start_server(**common, partition_index=1)

    assert commit_once_partition_one_is_back(first, swap) == 1
    assert met()
