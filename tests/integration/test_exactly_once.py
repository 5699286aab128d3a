"""Exactly once whatever the network does (issue 37, item 0): an old attempt of a commit that
arrives after its retry and after later commits of the same client is refused, not applied again.

Behind a cut cable a request can sit in TCP retransmission while the client times out, retries on
a new connection and moves on; when the cable heals, the old attempt is delivered. Its request id
is no longer the client's last, so the ledger needs the commit's number (`sequence`) to know it.
Here the late delivery is played by hand on each route: gRPC, and the data plane over TCP. The
same fault on real links is tests/integration/test_simulated_hosts.py.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.reasons import METADATA_KEY, Reason
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.data_plane_client import DataPlaneClient, commit_header
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer, open_stub

P = 64
ONES = np.ones(P, np.float32)
# A commit on one route: (stub, registration, request id, sequence) -> (status code, reason, version)
Route = Callable[[pb_grpc.ParameterServerStub, pb.RegisterResponse, str, int], tuple[grpc.StatusCode, str, int]]


def register(stub: pb_grpc.ParameterServerStub, client_id: str = "counting-client") -> pb.RegisterResponse:
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    initial = tensor_to_proto(np.zeros(P, np.float32))
    return stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=initial, client_id=client_id))


def by_grpc(
    stub: pb_grpc.ParameterServerStub, registration: pb.RegisterResponse, request_id: str, sequence: int
) -> tuple[grpc.StatusCode, str, int]:
    request = pb.CommitRequest(
        worker_id=registration.worker_id,
        base_version=0,
        kind=pb.PAYLOAD_KIND_UPDATE,
        payload=tensor_to_proto(ONES),
        request_id=request_id,
        sequence=sequence,
    )
    try:
        return grpc.StatusCode.OK, "", int(stub.Commit(request).version)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        reason = dict(error.trailing_metadata() or ()).get(METADATA_KEY, "")
        return error.code(), str(reason), -1


def by_data_plane(
    stub: pb_grpc.ParameterServerStub, registration: pb.RegisterResponse, request_id: str, sequence: int
) -> tuple[grpc.StatusCode, str, int]:
    """On a connection of its own, as a retry or a late attempt would come (a new connection)."""
    with DataPlaneClient(registration.data_plane.port) as client:
        hello = client.hello(registration.worker_id, registration.data_plane.ticket)
        assert hello.op == Op.HELLO | REPLY, hello.error
        header = commit_header(registration.worker_id, P, 0, request_id, kind=pb.PAYLOAD_KIND_UPDATE, sequence=sequence)
        client.send(Op.COMMIT, header, ONES.tobytes())
        frame = client.receive()
    if frame.error is not None:
        code = next(c for c in grpc.StatusCode if c.value[0] == frame.error.code)
        return code, frame.error.reason, -1
    reply = frame.message(pb.CommitResponse)
    assert isinstance(reply, pb.CommitResponse)
    return grpc.StatusCode.OK, "", int(reply.version)


ROUTES: dict[str, tuple[Route, Route]] = {
    "grpc": (by_grpc, by_grpc),
    "data-plane": (by_data_plane, by_data_plane),
    "applied-on-data-plane-late-on-grpc": (by_data_plane, by_grpc),
    "applied-on-grpc-late-on-data-plane": (by_grpc, by_data_plane),
}


@pytest.fixture
def downpour(start_server: StartServer) -> InProcessServer:
    return start_server(rule="downpour")


def theta(stub: pb_grpc.ParameterServerStub) -> np.ndarray:
    return np.frombuffer(stub.Pull(pb.PullRequest(known_version=-1)).parameters.data, np.float32)


@pytest.mark.parametrize("route", list(ROUTES))
def test_an_old_attempt_delivered_after_later_commits_is_refused_and_touches_nothing(
    downpour: InProcessServer, route: str
) -> None:
    apply, deliver_late = ROUTES[route]
    stub = open_stub(downpour.target)
    registration = register(stub)
    assert apply(stub, registration, "commit-1", 1) == (grpc.StatusCode.OK, "", 1)
    assert apply(stub, registration, "commit-2", 2) == (grpc.StatusCode.OK, "", 2)
    assert apply(stub, registration, "commit-3", 3) == (grpc.StatusCode.OK, "", 3)
    # Commit 1's first attempt, held by the network until now, and commit 2's: both refused.
    for request_id, sequence in (("commit-1", 1), ("commit-2", 2)):
        code, reason, _ = deliver_late(stub, registration, request_id, sequence)
        assert (code, reason) == (grpc.StatusCode.ABORTED, Reason.SUPERSEDED)
    # A retry of the last commit still answers with its outcome, and the next commit goes on.
    assert deliver_late(stub, registration, "commit-3", 3) == (grpc.StatusCode.OK, "", 3)
    assert deliver_late(stub, registration, "commit-4", 4) == (grpc.StatusCode.OK, "", 4)
    np.testing.assert_array_equal(theta(stub), np.full(P, 4.0, np.float32))  # θ counts 4 commits
    assert downpour.server.state.core.commits_applied == 4


def test_a_late_attempt_from_before_the_client_registered_again_is_refused(downpour: InProcessServer) -> None:
    """The client's numbering spans its registrations (lease expiry, server restart)."""
    stub = open_stub(downpour.target)
    first = register(stub)
    assert by_grpc(stub, first, "commit-1", 1)[2] == 1
    stub.Leave(pb.LeaveRequest(worker_id=first.worker_id))
    again = register(stub)
    assert by_grpc(stub, again, "commit-2", 2)[2] == 2
    assert by_grpc(stub, again, "commit-1", 1)[:2] == (grpc.StatusCode.ABORTED, Reason.SUPERSEDED)
    np.testing.assert_array_equal(theta(stub), np.full(P, 2.0, np.float32))


def test_unnumbered_commits_keep_their_old_meaning(downpour: InProcessServer) -> None:
    """A client that does not count (sequence 0): a retry of its last commit is still recognised,
    and every new request id is applied."""
    stub = open_stub(downpour.target)
    registration = register(stub)
    assert [by_grpc(stub, registration, request, 0)[2] for request in ("a", "a", "b", "c")] == [1, 1, 2, 3]
