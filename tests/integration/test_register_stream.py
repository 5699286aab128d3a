"""RegisterStream on real servers (issue 15: an authenticated request bounded by a few MiB): the
first worker of a model larger than --max-message-mb initialises θ with its values in pieces;
every malformed or stalled upload is refused before θ exists, and later workers' values are not
read at all."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.grpc_framing import data_frames
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.helpers import scrape_series, start_partitions, wait_for
from tests.integration.conftest import StartServer, open_stub

pytestmark = pytest.mark.timeout(60)

P = 300_000  # 1.2 MB of float32: past a 1 MiB --max-message-mb
BUFFERS = 1_000
PIECE = 65_536  # the SDK's default pieces (1 MiB of data and their framing) need 2 MiB messages


def _model(value: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    parameters = {"w": np.full((P - 10,), value, np.float32), "b": np.arange(10, dtype=np.float32)}
    return parameters, {"running_mean": np.full(BUFFERS, value + 0.5, np.float32)}


def _header(count: int, *, buffers: int | None = None, spec_count: int = P) -> pb.RegisterChunk:
    request = pb.RegisterRequest(
        spec=[pb.ParameterSpec(name="theta", shape=[spec_count], dtype=pb.DTYPE_FLOAT32)],
        initial_parameters=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[count]),
        omit_parameters=True,
    )
    if buffers is not None:
        request.buffer_spec.append(pb.ParameterSpec(name="bn", shape=[BUFFERS], dtype=pb.DTYPE_FLOAT32))
        request.initial_buffers.dtype = pb.DTYPE_FLOAT32
        request.initial_buffers.shape.append(buffers)
    return pb.RegisterChunk(header=request)


def _upload(header: pb.RegisterChunk, data: bytes) -> Iterator[pb.RegisterChunk]:
    yield header
    for start in range(0, len(data), PIECE):
        yield pb.RegisterChunk(data=data[start : start + PIECE])


def _refusal(call: object) -> tuple[grpc.StatusCode, str]:
    assert isinstance(call, grpc.RpcError) and isinstance(call, grpc.Call)
    reason = dict(call.trailing_metadata() or ()).get("gemps-reason", "")
    return call.code(), str(reason)


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_model_past_the_message_limit_initialises_theta_in_pieces(start_server: StartServer, partitions: int) -> None:
    servers = start_partitions(start_server, partitions, max_message_mb=1)
    parameters, buffers = _model(1.0)
    with (
        gemps.Client(servers[0].target, chunk_bytes=PIECE) as first,
        gemps.Client(servers[0].target, chunk_bytes=PIECE) as later,
    ):
        assert first.register(parameters, buffers).initialized_central
        assert not later.register(*_model(2.0)).initialized_central  # θ was the first's
        assert later.central is not None
        np.testing.assert_array_equal(later.central.flat, np.concatenate([parameters["w"], parameters["b"]]))
        np.testing.assert_array_equal(later.central.buffers, buffers["running_mean"])
        assert later.central.versions == (0,) * partitions
    # Partition 0 received all of θ (it keeps its range) in pieces; with 2, partition 1 its
    # 600 KB range in one message, within the limit.
    received = scrape_series(f"http://127.0.0.1:{servers[0].metrics_port}/metrics")
    label = "" if partitions == 1 else ',partition="0"'
    assert received[f'gemps_received_bytes_total{{method="RegisterStream"{label},plane="grpc"}}'] >= 4 * P


def test_a_model_past_the_message_limit_sent_whole_is_refused_with_a_hint(start_server: StartServer) -> None:
    server = start_server(max_message_mb=1)
    with (
        gemps.Client(server.target, streaming="never") as unary,
        pytest.raises(gemps.ResourceExhaustedError, match="--max-message-mb"),
    ):
        unary.register(_model(1.0)[0])
    assert not open_stub(server.target).Status(pb.StatusRequest()).initialized


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (_header(P + 1), Reason.BAD_SHAPE),  # more values than the spec has
        (_header(P, buffers=BUFFERS - 1), Reason.BAD_SHAPE),  # buffers the buffer spec does not have
        (_header(P, spec_count=0), Reason.BAD_SHAPE),  # an empty model
    ],
)
def test_an_upload_announcing_sizes_the_spec_does_not_have_is_refused_before_its_data(
    start_server: StartServer, header: pb.RegisterChunk, reason: Reason
) -> None:
    server = start_server(max_message_mb=1)
    stub = open_stub(server.target)
    with pytest.raises(grpc.RpcError) as refused:
        stub.RegisterStream(_upload(header, bytes(4 * (P + BUFFERS))))
    code, sent_reason = _refusal(refused.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert sent_reason in {reason.value, Reason.BAD_SPEC.value}
    received = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert received['gemps_received_bytes_total{method="RegisterStream",plane="grpc"}'] < 4096  # the header alone
    assert not stub.Status(pb.StatusRequest()).initialized


@pytest.mark.parametrize("data_bytes", [4 * P - 4, 4 * P + 4], ids=["short", "long"])
def test_an_upload_of_other_than_the_announced_bytes_is_refused_and_theta_stays_uninitialised(
    start_server: StartServer, data_bytes: int
) -> None:
    server = start_server(max_message_mb=1)
    stub = open_stub(server.target)
    with pytest.raises(grpc.RpcError) as refused:
        stub.RegisterStream(_upload(_header(P), bytes(data_bytes)))
    assert _refusal(refused.value) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_PAYLOAD.value)
    assert not stub.Status(pb.StatusRequest()).initialized
    values = np.arange(P, dtype=np.float32)
    reply = stub.RegisterStream(_upload(_header(P), values.tobytes()))  # a good one after it
    assert reply.initialized_central
    pulled = stub.Pull(pb.PullRequest(worker_id=reply.worker_id, known_version=-1))
    np.testing.assert_array_equal(np.frombuffer(pulled.parameters.data, np.float32), values)


def test_a_stalled_upload_is_cut_off_and_the_next_initialises_theta(start_server: StartServer) -> None:
    """One upload at a time: a second waits for the first, which stops sending halfway; the
    server gives up on it after --stream-idle-timeout and the second's values become θ."""
    server = start_server(max_message_mb=1, stream_idle_timeout=1.0)
    stub = open_stub(server.target)
    release = threading.Event()

    def stalling() -> Iterator[pb.RegisterChunk]:
        yield _header(P)
        yield pb.RegisterChunk(data=bytes(2 * P))
        release.wait(30)  # sends nothing more until the test ends

    stalled = stub.RegisterStream.future(stalling())
    # The stalling upload holds the upload lock once the server has read its first piece; only
    # then does the second start (else it may go first and find nothing to wait for).
    series = 'gemps_received_bytes_total{method="RegisterStream",plane="grpc"}'
    wait_for(
        lambda: scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics").get(series, 0) >= 2 * P,
        20,
        "the server to read the stalling upload's first piece",
    )
    values = np.linspace(-1, 1, P, dtype=np.float32)
    try:
        reply = stub.RegisterStream(_upload(_header(P), values.tobytes()), timeout=20)
        assert reply.initialized_central
        assert _refusal(stalled.exception(timeout=20)) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            Reason.STREAM_IDLE.value,
        )
    finally:
        release.set()
    pulled = stub.Pull(pb.PullRequest(worker_id=reply.worker_id, known_version=-1))
    np.testing.assert_array_equal(np.frombuffer(pulled.parameters.data, np.float32), values)


def test_a_worker_asked_for_initial_values_whose_upload_breaks_off_hands_the_task_on(
    start_server: StartServer,
) -> None:
    """The worker asked for θ's initial values starts its upload and is cut off (here it gives up:
    its call is cancelled, as a deadline behind a cut cable does): the next worker to register is
    asked for its values at once, not told to wait (`initializing`) for the rest of the 30 s grace,
    which outlasts the SDK's retries (seen between simulated hosts, issue 34)."""
    server = start_server(max_message_mb=1)
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="theta", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    with pytest.raises(grpc.RpcError) as asked:
        stub.Register(pb.RegisterRequest(spec=spec))  # the first: asked for its values
    assert _refusal(asked.value) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_INITIALIZED.value)
    release = threading.Event()

    def breaking_off() -> Iterator[pb.RegisterChunk]:
        yield _header(P)
        yield pb.RegisterChunk(data=bytes(2 * P))
        release.wait(30)

    upload = stub.RegisterStream.future(breaking_off())
    series = 'gemps_received_bytes_total{method="RegisterStream",plane="grpc"}'
    try:
        wait_for(
            lambda: scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics").get(series, 0) >= 2 * P,
            20,
            "the server to read the upload's first piece",
        )
        upload.cancel()

        def next_worker() -> tuple[grpc.StatusCode, str] | None:
            """The next worker's answer once the server has seen the upload end (None before)."""
            try:
                stub.Register(pb.RegisterRequest(spec=spec))
            except grpc.RpcError as refused:
                answer = _refusal(refused)
                return None if answer[1] == Reason.INITIALIZING.value else answer
            return grpc.StatusCode.OK, ""

        answer = wait_for(next_worker, 5.0, "the next worker to be asked for its values (not told to wait)")
    finally:
        release.set()
    assert answer == (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_INITIALIZED.value)


def test_the_client_asked_for_initial_values_is_asked_again_the_others_wait(start_server: StartServer) -> None:
    """A client asked for θ's initial values whose upload never reached the server (lost behind a
    cut cable) registers again: it is asked again, not told to wait for itself until it gives up."""
    server = start_server(max_message_mb=1)
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="theta", shape=[P], dtype=pb.DTYPE_FLOAT32)]

    def answer(client_id: str) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(pb.RegisterRequest(spec=spec, client_id=client_id))
        return _refusal(refused.value)

    asked = (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_INITIALIZED.value)
    assert answer("client-a") == asked
    assert answer("client-b") == (grpc.StatusCode.UNAVAILABLE, Reason.INITIALIZING.value)
    assert answer("client-a") == asked


def test_once_theta_exists_an_upload_is_answered_without_reading_it(start_server: StartServer) -> None:
    server = start_server(max_message_mb=1)
    stub = open_stub(server.target)
    values = np.full(P, 3.0, np.float32)
    assert stub.RegisterStream(_upload(_header(P), values.tobytes())).initialized_central
    before = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    frames = [_header(P), *(pb.RegisterChunk(data=piece) for piece in data_frames(bytes(4 * P), PIECE))]
    reply = stub.RegisterStream(iter(frames))
    assert not reply.initialized_central and reply.worker_id
    after = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    series = 'gemps_received_bytes_total{method="RegisterStream",plane="grpc"}'
    assert after[series] - before[series] < 4096  # the header alone: its values are not needed
    pulled = stub.Pull(pb.PullRequest(worker_id=reply.worker_id, known_version=-1))
    np.testing.assert_array_equal(np.frombuffer(pulled.parameters.data, np.float32), values)


def test_a_model_past_max_parameters_is_refused_before_its_values_are_read(start_server: StartServer) -> None:
    """The first worker decides θ's size; --max-parameters bounds it (buffers count too), from the
    header alone, and the SDK's large-model path is refused at its first, value-less Register."""
    server = start_server(max_message_mb=1, max_parameters=P)
    stub = open_stub(server.target)
    with pytest.raises(grpc.RpcError) as refused:
        stub.RegisterStream(_upload(_header(P, buffers=BUFFERS), bytes(4 * (P + BUFFERS))))
    assert _refusal(refused.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.TOO_LARGE.value)
    assert "--max-parameters" in str(refused.value.details())
    received = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert received['gemps_received_bytes_total{method="RegisterStream",plane="grpc"}'] < 4096  # the header alone
    with (
        gemps.Client(server.target, chunk_bytes=PIECE) as sdk,
        pytest.raises(gemps.ResourceExhaustedError) as too_large,
    ):
        sdk.register(*_model(1.0))  # P + BUFFERS values
    assert too_large.value.reason == Reason.TOO_LARGE
    assert not stub.Status(pb.StatusRequest()).initialized
    assert stub.RegisterStream(_upload(_header(P), bytes(4 * P))).initialized_central  # P values: within


def test_max_parameters_bounds_each_partitions_range(start_server: StartServer) -> None:
    """With θ in 2 partitions each process holds half: a model twice the limit fits."""
    servers = start_partitions(start_server, 2, max_message_mb=1, max_parameters=P // 2 + BUFFERS)
    parameters, buffers = _model(1.0)
    with gemps.Client(servers[0].target, chunk_bytes=PIECE) as first:
        assert first.register(parameters, buffers).initialized_central
        assert first.central is not None and first.central.flat.size == P
