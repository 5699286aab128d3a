"""Real servers on free ports: in this process by default, as child processes where the process
boundary is the point; raw stubs for sending malformed requests."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from gemps_worker.simulated_hosts import SimulatedNetwork, unavailable_reason
from tests.etcd_server import etcd_server
from tests.helpers import InProcessServer, free_port

StartServer = Callable[..., InProcessServer]
StartServerProcess = Callable[..., ServerProcess]

#: the last lines of each child server's log shown under a failed test (the logs go with the test)
LOG_LINES_ON_FAILURE = 150
_SERVER_PROCESSES = pytest.StashKey[list[ServerProcess]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under a failed test, the last lines of each server process it started: a replica's view of
    an election is in its log, which goes with its temporary folder once the test is over."""
    report = yield
    if report.when == "call" and report.failed:
        for server in item.stash.get(_SERVER_PROCESSES, []):
            lines = server.log().splitlines()[-LOG_LINES_ON_FAILURE:]
            report.sections.append((f"{server.target}'s log, its last {len(lines)} lines", "\n".join(lines)))
    return report


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    """Start in-process servers with `gemps server` options; all are stopped after the test."""
    started: list[InProcessServer] = []

    def start(**options: Any) -> InProcessServer:
        server = InProcessServer(**options).start()
        started.append(server)
        return server

    yield start
    for server in reversed(started):  # last in, first out: each restores the log level it found
        server.stop()


@pytest.fixture
def server(start_server: StartServer) -> InProcessServer:
    return start_server()


# The routes a client's commits and pulls can take: the data plane through shared memory (a
# client on the server's host), the data plane over TCP (as between hosts), gRPC.
ROUTES = {"shared": ("data", "on"), "tcp": ("data", "off"), "grpc": ("grpc", "on")}


@pytest.fixture(params=list(ROUTES))
def plane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every gemps.Client the test makes (child processes included) commits and pulls on this
    route (GEMPS_PLANE, GEMPS_SHARED_MEMORY): a module's `pytestmark =
    pytest.mark.usefixtures("plane")` runs its SDK tests over each."""
    plane, shared_memory = ROUTES[request.param]
    monkeypatch.setenv("GEMPS_PLANE", plane)
    monkeypatch.setenv("GEMPS_SHARED_MEMORY", shared_memory)
    return str(request.param)


@pytest.fixture
def start_server_process(request: pytest.FixtureRequest) -> Iterator[StartServerProcess]:
    """Start `gemps server` child processes; all are stopped after the test (their logs' last
    lines shown under a failure). Their gRPC port comes from the suite's band (free_port) unless
    given: a test may restart a server on its port, which another test's socket could otherwise be
    given while it is down."""
    started: list[ServerProcess] = []
    request.node.stash[_SERVER_PROCESSES] = started

    def start(**options: Any) -> ServerProcess:
        server = ServerProcess(**{"port": free_port(), **options}).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def network() -> Iterator[SimulatedNetwork]:
    """Simulated hosts (root only: skipped with one line elsewhere)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SimulatedNetwork() as made:
        yield made


def open_stub(target: str, max_message_mb: int = 64) -> pb_grpc.ParameterServerStub:
    limit = max_message_mb * 1024 * 1024
    channel = grpc.insecure_channel(
        target, options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    )
    return pb_grpc.ParameterServerStub(channel)


SPEC = [
    pb.ParameterSpec(name="layer.weight", shape=[4, 3], dtype=pb.DTYPE_FLOAT32),
    pb.ParameterSpec(name="layer.bias", shape=[4], dtype=pb.DTYPE_FLOAT32),
]
NUM_PARAMETERS = 16


def register(
    stub: pb_grpc.ParameterServerStub, spec: list[pb.ParameterSpec] | None = None, client_id: str = ""
) -> pb.RegisterResponse:
    initial = np.linspace(-1, 1, NUM_PARAMETERS, dtype=np.float32)
    return stub.Register(
        pb.RegisterRequest(
            spec=SPEC if spec is None else spec, initial_parameters=tensor_to_proto(initial), client_id=client_id
        )
    )


def central(stub: pb_grpc.ParameterServerStub) -> tuple[int, bytes]:
    reply = stub.Pull(pb.PullRequest(known_version=-1))
    return reply.version, reply.parameters.data


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    """One real etcd for a test module (started once: its tests' jobs have names, so keys, of their
    own). Up before a test's servers and down after them: replicas resign as they stop."""
    with etcd_server() as running:
        yield running
