"""Each malformed request gets the right status code and a clear message; theta never changes;
the server keeps serving."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.helpers import InProcessServer
from tests.integration.conftest import NUM_PARAMETERS, SPEC, StartServer, central, open_stub, register

Code = grpc.StatusCode


def good_payload() -> pb.Tensor:
    return tensor_to_proto(np.full(NUM_PARAMETERS, 0.5, np.float32))


def commit_request(worker_id: str, **overrides: object) -> pb.CommitRequest:
    fields: dict[str, object] = {
        "worker_id": worker_id,
        "base_version": 0,
        "kind": pb.PAYLOAD_KIND_GRADIENT,
        "payload": good_payload(),
    }
    fields.update(overrides)
    return pb.CommitRequest(**fields)  # type: ignore[arg-type]


def expect_error(call: object, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    error = info.value
    assert error.code() == code, error.details()
    for fragment in fragments:
        assert fragment in (error.details() or ""), error.details()


def assert_unchanged_and_serving(stub: pb_grpc.ParameterServerStub, before: tuple[int, bytes], worker_id: str) -> None:
    assert central(stub) == before
    # Still serving: a good commit goes through afterwards.
    reply = stub.Commit(commit_request(worker_id, base_version=before[0]))
    assert reply.version == before[0] + 1


@pytest.fixture
def registered(server: InProcessServer) -> tuple[pb_grpc.ParameterServerStub, str, tuple[int, bytes]]:
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    stub.Commit(commit_request(worker_id))  # version 1, so "stale" and "future" both exist
    return stub, worker_id, central(stub)


BAD_COMMITS: dict[str, tuple[dict[str, object], grpc.StatusCode, tuple[str, ...]]] = {
    "wrong payload length": (
        {"payload": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[NUM_PARAMETERS], data=b"\0" * 60)},
        Code.INVALID_ARGUMENT,
        ("payload: 60 bytes of data", "needs 64"),
    ),
    "garbage bytes in tensor": (
        {"payload": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[NUM_PARAMETERS], data=b"\x8f\xffgarbage!" * 7)},
        Code.INVALID_ARGUMENT,
        ("payload: 70 bytes of data",),
    ),
    "garbage that decodes to NaN": (
        {"payload": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[NUM_PARAMETERS], data=b"\xff" * 64)},
        Code.INVALID_ARGUMENT,
        ("NaN or Inf",),
    ),
    "unspecified dtype": (
        {"payload": pb.Tensor(shape=[NUM_PARAMETERS], data=b"\0" * 64)},
        Code.INVALID_ARGUMENT,
        ("unsupported dtype DTYPE_UNSPECIFIED",),
    ),
    "unknown dtype": (
        {"payload": pb.Tensor(dtype=9, shape=[NUM_PARAMETERS], data=b"\0" * 64)},  # type: ignore[arg-type]
        Code.INVALID_ARGUMENT,
        ("unsupported dtype",),
    ),
    "mismatched shape": (
        {"payload": tensor_to_proto(np.zeros(NUM_PARAMETERS + 1, np.float32))},
        Code.INVALID_ARGUMENT,
        ("payload shape [17]", "[16]"),
    ),
    "per-parameter shape instead of flat": (
        {"payload": tensor_to_proto(np.zeros((4, 4), np.float32))},
        Code.INVALID_ARGUMENT,
        ("payload shape [4, 4]",),
    ),
    "negative dimension": (
        {"payload": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-16], data=b"")},
        Code.INVALID_ARGUMENT,
        ("negative dimension",),
    ),
    "NaN in gradient": (
        {"payload": tensor_to_proto(np.where(np.arange(NUM_PARAMETERS) == 3, np.nan, 1.0).astype(np.float32))},
        Code.INVALID_ARGUMENT,
        ("NaN or Inf",),
    ),
    "Inf in gradient": (
        {"payload": tensor_to_proto(np.where(np.arange(NUM_PARAMETERS) == 0, -np.inf, 1.0).astype(np.float32))},
        Code.INVALID_ARGUMENT,
        ("NaN or Inf",),
    ),
    "negative base_version": ({"base_version": -1}, Code.INVALID_ARGUMENT, ("base_version -1 is negative",)),
    "future base_version": ({"base_version": 99}, Code.INVALID_ARGUMENT, ("base_version 99 is ahead", "version 1")),
    "unspecified payload kind": (
        {"kind": pb.PAYLOAD_KIND_UNSPECIFIED},
        Code.INVALID_ARGUMENT,
        ("PAYLOAD_KIND_GRADIENT",),
    ),
    "unknown worker": ({"worker_id": "nobody"}, Code.NOT_FOUND, ("unknown worker 'nobody'", "register again")),
}


@pytest.mark.parametrize("case", list(BAD_COMMITS))
def test_bad_commit_is_rejected_and_changes_nothing(
    case: str, registered: tuple[pb_grpc.ParameterServerStub, str, tuple[int, bytes]]
) -> None:
    stub, worker_id, before = registered
    overrides, code, fragments = BAD_COMMITS[case]
    request = commit_request(worker_id)
    for key, value in overrides.items():
        if isinstance(value, pb.Tensor):
            getattr(request, key).CopyFrom(value)
        else:
            setattr(request, key, value)
    expect_error(lambda: stub.Commit(request), code, *fragments)
    assert_unchanged_and_serving(stub, before, worker_id)


def test_rejections_are_counted(registered: tuple[pb_grpc.ParameterServerStub, str, tuple[int, bytes]]) -> None:
    stub, worker_id, _ = registered
    expect_error(lambda: stub.Commit(commit_request(worker_id, base_version=-5)), Code.INVALID_ARGUMENT)
    status = stub.Status(pb.StatusRequest())
    assert (status.commits_applied, status.commits_rejected) == (1, 1)


def test_commit_before_any_register(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    expect_error(lambda: stub.Commit(commit_request("w")), Code.FAILED_PRECONDITION, "not initialised")
    expect_error(lambda: stub.Pull(pb.PullRequest()), Code.FAILED_PRECONDITION, "not initialised")
    assert register(stub).version == 0  # and the server still serves


def test_first_register_without_initial_parameters(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    expect_error(lambda: stub.Register(pb.RegisterRequest(spec=SPEC)), Code.FAILED_PRECONDITION, "initial_parameters")
    assert not stub.Status(pb.StatusRequest()).initialized


def test_one_worker_at_a_time_is_asked_for_the_initial_values(server: InProcessServer) -> None:
    """Workers starting together register without values first; the first is told to send them,
    the others to retry (UNAVAILABLE) until it has: one upload of θ, not one per worker."""
    stub = open_stub(server.target)
    expect_error(lambda: stub.Register(pb.RegisterRequest(spec=SPEC)), Code.FAILED_PRECONDITION, "initial_parameters")
    for _ in range(3):
        expect_error(lambda: stub.Register(pb.RegisterRequest(spec=SPEC)), Code.UNAVAILABLE, "another worker")
    assert register(stub).version == 0  # the told one's values (any worker's, in fact) initialise it
    assert stub.Register(pb.RegisterRequest(spec=SPEC)).version == 0  # the others now get in


def test_first_register_with_wrong_initial_size(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    request = pb.RegisterRequest(spec=SPEC, initial_parameters=tensor_to_proto(np.zeros(5, np.float32)))
    expect_error(lambda: stub.Register(request), Code.INVALID_ARGUMENT, "5 values", "describes 16")
    assert not stub.Status(pb.StatusRequest()).initialized


def spec_with(**changes: object) -> list[pb.ParameterSpec]:
    spec = [pb.ParameterSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in SPEC]
    for key, value in changes.items():
        if key == "shape":
            spec[0].shape[:] = value  # type: ignore[call-overload]
        else:
            setattr(spec[0], key, value)
    return spec


@pytest.mark.parametrize(
    "spec,code,fragments",
    [
        (spec_with(shape=[3, 4]), Code.FAILED_PRECONDITION, ("server has 'layer.weight' [4, 3]", "[3, 4]")),
        (
            spec_with(name="layer.w"),
            Code.FAILED_PRECONDITION,
            ("missing from worker: layer.weight", "unknown to server: layer.w"),
        ),
        (SPEC[:1], Code.FAILED_PRECONDITION, ("server has 2 parameters, worker sent 1",)),
        (spec_with(dtype=pb.DTYPE_UNSPECIFIED), Code.INVALID_ARGUMENT, ("dtype DTYPE_UNSPECIFIED",)),
        ([], Code.INVALID_ARGUMENT, ("spec is empty",)),
        ([SPEC[0], SPEC[0]], Code.INVALID_ARGUMENT, ("appears twice",)),
    ],
    ids=["shape", "names", "count", "dtype", "empty", "duplicate"],
)
def test_second_worker_with_bad_spec(
    spec: list[pb.ParameterSpec],
    code: grpc.StatusCode,
    fragments: tuple[str, ...],
    registered: tuple[pb_grpc.ParameterServerStub, str, tuple[int, bytes]],
) -> None:
    stub, worker_id, before = registered
    expect_error(lambda: register(stub, spec), code, *fragments)
    assert stub.Status(pb.StatusRequest()).active_workers == 1
    assert_unchanged_and_serving(stub, before, worker_id)


def test_oversized_message(start_server: StartServer) -> None:
    server = start_server(max_message_mb=1)
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    before = central(stub)
    huge = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[NUM_PARAMETERS], data=b"\0" * (2 * 1024 * 1024))
    expect_error(lambda: stub.Commit(commit_request(worker_id, payload=huge)), Code.RESOURCE_EXHAUSTED)
    assert_unchanged_and_serving(stub, before, worker_id)


def test_too_many_workers(start_server: StartServer) -> None:
    server = start_server(max_workers=2)
    stub = open_stub(server.target)
    register(stub)
    register(stub)
    expect_error(lambda: register(stub), Code.RESOURCE_EXHAUSTED, "2 workers", "--max-workers")


def test_evicted_worker(start_server: StartServer) -> None:
    server = start_server(lease_ttl=0.4)
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    deadline = time.monotonic() + 10
    while stub.Status(pb.StatusRequest()).active_workers and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the observable condition, not sleeping a guessed duration
    before = central(stub)
    expect_error(lambda: stub.Commit(commit_request(worker_id)), Code.NOT_FOUND, "evicted", "register again")
    assert central(stub) == before
    assert "worker evicted" in server.log()


def test_left_worker_cannot_commit(registered: tuple[pb_grpc.ParameterServerStub, str, tuple[int, bytes]]) -> None:
    stub, worker_id, before = registered
    stub.Leave(pb.LeaveRequest(worker_id=worker_id))
    expect_error(lambda: stub.Commit(commit_request(worker_id, base_version=1)), Code.NOT_FOUND)
    expect_error(lambda: stub.Leave(pb.LeaveRequest(worker_id=worker_id)), Code.NOT_FOUND)
    assert central(stub) == before


def test_bytes_that_are_not_a_protobuf_message(
    registered: tuple[pb_grpc.ParameterServerStub, str, tuple[int, bytes]], server: InProcessServer
) -> None:
    stub, worker_id, before = registered
    channel = grpc.insecure_channel(server.target)
    raw_commit: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
        "/gemps.v1.ParameterServer/Commit"
    )  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as info:
        raw_commit(b"\xff\xff\xff\xff garbage that is no protobuf")
    assert info.value.code() != grpc.StatusCode.OK
    assert_unchanged_and_serving(stub, before, worker_id)
