"""Shared memory a local client attaches is charged to it, and bounded (issue 42, item 6;
server/gemps_server/wire/shared_memory.py).

The attack: registered local connections attach memfds they never touched and pull once, so the
server writes θ into them, faults their pages in, and holds them (its RSS, its cgroup's memory):
763 MiB for 200 connections at P = 1M. Now a memfd must be written (allocated) by its client
before it is attached, and what every connection together may attach is bounded by
--max-shared-memory: past it, ATTACH is refused RESOURCE_EXHAUSTED (shared_memory_limit, counted),
the bytes are given back when a connection ends, and an honest SDK client past the bound commits
through the socket. A real server process, so its memory is its own to measure."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import sys
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import gemps
from gemps.data_plane_transport import DataPlaneTransport
from gemps_proto.data_plane_frames import REPLY, SHARED, Op
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.wire.shared_memory_budget import PER_WORKER
from gemps_worker.cluster import ServerProcess
from tests.data_plane_client import DataPlaneClient
from tests.helpers import scrape_series, wait_for
from tests.integration.conftest import StartServerProcess, open_stub

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd, seals and abstract sockets are Linux's")

MIB = 1 << 20
P = 1 << 20  # the attack's model: 4 MiB of float32 θ
SIZE = 4 * P
ATTACKERS = 200
LIMIT_MB = 32  # --max-shared-memory in the attack's test: 8 regions of θ
# What else the server's shared pages may grow by meanwhile (its own memfds, a pull's slack).
MARGIN = 16 * MIB


def rss_shmem(pid: int) -> int:
    """Bytes of shared memory mapped in the process `pid` (RssShmem: its pages of memfds)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/PID/status")


def series(server: ServerProcess) -> dict[str, float]:
    return scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")


def refusals(server: ServerProcess) -> dict[str, float]:
    prefix = 'gemps_data_plane_refusals_total{reason="'
    return {name[len(prefix) : -2]: value for name, value in series(server).items() if name.startswith(prefix)}


def attached_bytes(server: ServerProcess) -> float:
    return series(server)["gemps_data_plane_shared_memory_bytes"]


def memfd(touched: bool) -> int:
    """θ's float32 size of memory, sealed as the server asks; `touched`: allocated here first
    (posix_fallocate, as the SDK does), else never written (its pages exist nowhere yet)."""
    fd = os.memfd_create("test-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    if touched:
        os.posix_fallocate(fd, 0, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def registered(server: ServerProcess, workers: int = 1) -> list[pb.RegisterResponse]:
    """Workers of a P-value model (θ initialised by the first)."""
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    initial = tensor_to_proto(np.linspace(-1, 1, P, dtype=np.float32))
    replies = [stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=initial))]
    replies += [stub.Register(pb.RegisterRequest(spec=spec)) for _ in range(workers - 1)]
    assert replies[0].data_plane.local_socket, "shared memory is on"
    return replies


@contextlib.contextmanager
def attackers(
    workers: list[pb.RegisterResponse], count: int, touched: bool
) -> Iterator[list[pb.DataPlaneError | None]]:
    """`count` local connections of the registrations `workers` (in turn), open together, each
    attaching a memfd and, when that is answered, pulling once into it: what each ATTACH got
    (None: attached)."""
    clients: list[DataPlaneClient] = []
    answers: list[pb.DataPlaneError | None] = []
    try:
        for index in range(count):
            reply = workers[index % len(workers)]
            client = DataPlaneClient(0, local_socket=reply.data_plane.local_socket)
            clients.append(client)
            assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
            fd = memfd(touched)
            frame = client.attach([fd], SIZE)
            os.close(fd)  # the server has its own copy (or has closed it): the pages are its mapping's
            answers.append(frame.error)
            if frame.op == Op.ATTACH | REPLY:
                client.send(Op.PULL, pb.PullRequest(worker_id=reply.worker_id).SerializeToString(), flags=SHARED)
                assert client.receive(memoryview(b"")).op == Op.PULL | REPLY
        yield answers
    finally:
        for client in clients:
            client.close()


@contextlib.contextmanager
def one_attach(reply: pb.RegisterResponse, fd: int) -> Iterator[pb.DataPlaneError | None]:
    """One local connection attaching the memfd `fd` (closed here): what the ATTACH got."""
    with DataPlaneClient(0, local_socket=reply.data_plane.local_socket) as client:
        assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
        frame = client.attach([fd], SIZE)
        os.close(fd)
        yield frame.error


def test_attaches_past_max_shared_memory_are_refused_and_the_servers_memory_stays_bounded(
    start_server_process: StartServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEMPS_MAX_SHARED_MEMORY", str(LIMIT_MB))  # as a user sets it (the flag's variable)
    server = start_server_process(rule="downpour", max_message_mb=8)
    workers = registered(server, ATTACKERS // PER_WORKER)  # each with as many regions as a worker may have
    before = rss_shmem(server.pid)
    fit = LIMIT_MB * MIB // SIZE
    with attackers(workers, ATTACKERS, touched=True) as answers:
        grown = rss_shmem(server.pid) - before
        refused = [answer for answer in answers if answer is not None]
        assert len(answers) - len(refused) == fit, "as many as fit are attached, no more"
        assert grown <= LIMIT_MB * MIB + MARGIN, f"{grown / MIB:.0f} MiB of shared pages added"
        for answer in refused:
            assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert answer.reason == "shared_memory_limit" and "--max-shared-memory" in answer.message
        assert refusals(server)["shared_memory_limit"] == ATTACKERS - fit
        assert attached_bytes(server) == fit * SIZE
        assert series(server)["gemps_data_plane_shared_memory_limit_bytes"] == LIMIT_MB * MIB
    # Given back when the connections end: the gauge falls to zero, and the next one attaches.
    wait_for(lambda: attached_bytes(server) == 0, timeout=10, what="shared memory given back")
    wait_for(lambda: rss_shmem(server.pid) <= before + MARGIN, timeout=10, what="shared pages unmapped")
    with attackers(workers, 1, touched=True) as answers:
        assert answers == [None]


def test_one_worker_cannot_take_every_place(start_server_process: StartServerProcess) -> None:
    server = start_server_process(rule="downpour", max_message_mb=8)  # the default bound
    hoarder, honest = registered(server, 2)
    before = rss_shmem(server.pid)
    with attackers([hoarder], ATTACKERS, touched=True) as answers:
        assert answers[:PER_WORKER] == [None] * PER_WORKER
        refused = answers[PER_WORKER:]
        assert all(answer is not None and answer.reason == "shared_memory_limit" for answer in refused)
        assert refused[0] is not None and f"at most {PER_WORKER} a worker" in refused[0].message
        assert rss_shmem(server.pid) - before <= PER_WORKER * SIZE + MARGIN
        with attackers([honest], 1, touched=True) as theirs:  # another worker still attaches
            assert theirs == [None]
        assert refusals(server)["shared_memory_limit"] == ATTACKERS - PER_WORKER


def test_memory_its_client_never_wrote_is_refused_and_costs_the_server_nothing(
    start_server_process: StartServerProcess,
) -> None:
    server = start_server_process(rule="downpour", max_message_mb=8)  # the default bound
    workers = registered(server)
    before = rss_shmem(server.pid)
    with attackers(workers, ATTACKERS, touched=False) as answers:
        grown = rss_shmem(server.pid) - before
        assert grown <= MARGIN, f"{grown / MIB:.0f} MiB of shared pages added by memory no client wrote"
        assert all(answer is not None and answer.reason == "malformed" for answer in answers)
        assert answers[0] is not None and "not written" in answers[0].message
        assert refusals(server)["bad_attach"] == ATTACKERS
    assert attached_bytes(server) == 0


def test_once_attached_its_pages_cannot_be_freed_nor_mapped_writable_again(
    start_server_process: StartServerProcess,
) -> None:
    """Pages freed after the check would be made again by the server's next reply, charged to it:
    once mapped, the server seals the memfd F_SEAL_FUTURE_WRITE, and hole punching fails."""
    server = start_server_process(rule="downpour", max_message_mb=8)
    reply = registered(server)[0]
    fd = memfd(touched=True)
    memory = mmap.mmap(fd, SIZE)  # mapped before ATTACH, as a client must: it writes there
    with contextlib.closing(memory), DataPlaneClient(0, local_socket=reply.data_plane.local_socket) as client:
        assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
        assert client.attach([fd], SIZE).op == Op.ATTACH | REPLY
        with pytest.raises(PermissionError):
            memory.madvise(mmap.MADV_REMOVE)  # fallocate(PUNCH_HOLE) underneath
        with pytest.raises(PermissionError):
            mmap.mmap(fd, SIZE)  # a new writable mapping
        assert os.fstat(fd).st_blocks * 512 >= SIZE
        before = rss_shmem(server.pid)
        memory[:8] = b"\x00" * 8  # the mapping it had still writes
        client.send(Op.PULL, pb.PullRequest(worker_id=reply.worker_id).SerializeToString(), flags=SHARED)
        frame = client.receive(memoryview(memory))
        assert frame.op == Op.PULL | REPLY and len(frame.payload) == SIZE
        assert rss_shmem(server.pid) - before <= SIZE + MARGIN  # its pages, now mapped by the server too
    os.close(fd)
    # A memfd sealed against further seals cannot be sealed so: refused before it is mapped.
    sealed = memfd(touched=True)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    with one_attach(reply, sealed) as answer:
        assert answer is not None and answer.reason == "malformed" and "F_SEAL_FUTURE_WRITE" in answer.message


def test_an_honest_sdk_client_past_the_bound_commits_through_the_socket_and_says_why_once(
    start_server_process: StartServerProcess, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEMPS_MAX_SHARED_MEMORY", str(SIZE // MIB))  # one region of θ
    server = start_server_process(rule="downpour", max_message_mb=8)
    with attackers(registered(server), 1, touched=True) as answers:  # the one region that fits is taken
        assert answers == [None]
        with caplog.at_level(logging.WARNING, "gemps.client"), gemps.Client(server.target, plane="data") as client:
            client.register({"w": np.zeros(P, np.float32)})
            for _ in range(3):
                result = client.commit(np.full(P, 0.5, np.float32))
            transport = client._router.sessions[0].transport
            assert isinstance(transport, DataPlaneTransport) and not transport.shared and transport.plane == "data"
        assert result.version == 3
        said = [record.getMessage() for record in caplog.records if "--max-shared-memory" in record.getMessage()]
        assert len(said) == 1, said
        assert refusals(server)["shared_memory_limit"] == 1
