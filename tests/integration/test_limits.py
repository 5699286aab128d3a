"""Limits on what a client can make the server keep or wait for (issue 15, items 6, 8 and 10):
names and labels, spec sizes and empty models are refused up front, with the right status and
reason, and leave nothing behind; a stream that stops sending is refused and frees its buffer;
registrations that never commit cannot hold a full server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.reasons import METADATA_KEY
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.validation import MAX_NAME_LENGTH, MAX_SPEC_ENTRIES
from tests.helpers import InProcessServer, scrape_series, wait_for
from tests.integration.conftest import SPEC, StartServer, open_stub, register


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


def reason(error: grpc.RpcError) -> str:
    metadata: Any = error.trailing_metadata()
    return str(dict(metadata or ())[METADATA_KEY])


def test_a_long_worker_name_is_refused_and_not_kept(start_server: StartServer) -> None:
    # Within a raised --max-message-mb: at the default (4) gRPC refuses an 8 MiB request unread
    # (test_reliability_memory.py); here the name reaches the server's own check.
    server = start_server(max_message_mb=16)
    stub = open_stub(server.target)
    request = pb.RegisterRequest(
        spec=SPEC, initial_parameters=tensor_to_proto(np.zeros(16, np.float32)), worker_name="w" * (8 << 20)
    )
    error = refused(lambda: stub.Register(request))
    assert reason(error) == "too_long" and f"at most {MAX_NAME_LENGTH}" in str(error.details())
    assert stub.Status(pb.StatusRequest()).active_workers == 0
    request.worker_name = "w" * MAX_NAME_LENGTH  # the limit itself is fine
    assert stub.Register(request).worker_id
    log = server.log()
    assert "worker_name has 8388608 characters" in log and "w" * 2000 not in log  # logged, clipped


def test_a_long_dataset_label_is_refused_and_status_stays_small(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    register(stub)
    report = pb.EvaluationReport(version=0, loss=0.5, accuracy=0.5, num_samples=10, dataset="d" * (1 << 20))
    assert reason(refused(lambda: stub.ReportEvaluation(report))) == "too_long"
    status = stub.Status(pb.StatusRequest())
    assert not status.HasField("last_evaluation") and status.ByteSize() < 10_000


def test_a_spec_with_too_many_entries_is_refused_before_it_is_read(server: InProcessServer) -> None:
    stub = open_stub(server.target, max_message_mb=256)
    entry = pb.ParameterSpec(name="p", shape=[1], dtype=pb.DTYPE_FLOAT32)
    request = pb.RegisterRequest(spec=[entry] * (MAX_SPEC_ENTRIES + 1))
    error = refused(lambda: stub.Register(request))
    assert reason(error) == "bad_spec" and f"{MAX_SPEC_ENTRIES + 1} entries" in str(error.details())


def test_a_model_without_values_cannot_take_the_server(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    empty = [pb.ParameterSpec(name="nothing", shape=[0, 3], dtype=pb.DTYPE_FLOAT32)]
    request = pb.RegisterRequest(spec=empty, initial_parameters=tensor_to_proto(np.zeros(0, np.float32)))
    assert reason(refused(lambda: stub.Register(request))) == "bad_spec"
    assert not stub.Status(pb.StatusRequest()).initialized
    assert register(stub).worker_id  # an honest worker still initialises it


def test_streams_that_stop_sending_are_refused_and_free_their_buffers(start_server: StartServer) -> None:
    """Two CommitStreams send a header and then nothing, holding both buffers: the server refuses
    them after --stream-idle-timeout, and a streamed commit behind them goes through."""
    server = start_server(max_streamed_payloads=2, stream_idle_timeout=1.0)
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    release = threading.Event()
    codes: list[tuple[grpc.StatusCode, str]] = []

    header = pb.CommitChunk(
        header=pb.CommitRequest(
            worker_id=worker_id, kind=pb.PAYLOAD_KIND_GRADIENT, payload=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[16])
        )
    ).SerializeToString()

    def stall() -> None:
        def frames() -> Iterator[bytes]:
            yield header
            release.wait(60)  # and then nothing

        channel = grpc.insecure_channel(server.target)
        call = channel.stream_stream("/gemps.v1.ParameterServer/CommitStream", lambda b: b, lambda b: b)
        try:
            list(call(frames(), timeout=60))
        except grpc.RpcError as error:
            codes.append((error.code(), reason(error)))
        finally:
            channel.close()

    stalled = [threading.Thread(target=stall) for _ in range(2)]
    for thread in stalled:
        thread.start()
    # Both hold a buffer once the server has read their headers; only then does the commit start
    # (on a loaded machine it could otherwise take a buffer first and end the test before them).
    header_bytes = 'gemps_received_bytes_total{method="CommitStream",plane="grpc"}'
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    wait_for(lambda: scrape_series(url).get(header_bytes, 0) >= 2 * len(header), 30, "both headers read")
    try:
        # CommitStream's buffers are the point: this commit must take gRPC, not the data plane.
        with gemps.Client(server.target, streaming="always", timeout=30, plane="grpc") as client:
            client.register({"layer.weight": np.zeros((4, 3), np.float32), "layer.bias": np.zeros(4, np.float32)})
            assert client.commit(np.ones(16, np.float32)).version >= 1
        # The commit can go through on the first refusal's buffer before the other stream's timer
        # fires: ending that stream's frames then would make it an incomplete payload instead.
        wait_for(lambda: len(codes) == 2, 30, "both stalled streams refused")
    finally:
        release.set()
        for thread in stalled:
            thread.join(30)
    assert codes == [(grpc.StatusCode.DEADLINE_EXCEEDED, "stream_idle")] * 2


def test_registrations_kept_alive_by_pulls_alone_give_way_to_a_newcomer(start_server: StartServer) -> None:
    """A full server whose places are held by workers that only pull (cheap; each holds GEM state)
    admits a newcomer in the place of the one longest without a commit, once that is longer
    than the lease TTL; a worker that commits keeps its place."""
    server = start_server(max_workers=3, lease_ttl=1.0)
    stub = open_stub(server.target)
    committer = register(stub).worker_id
    squatters = [register(stub).worker_id for _ in range(2)]
    stop = threading.Event()

    def keep_alive() -> None:  # the squatters pull, the committer commits, until the test ends
        payload = tensor_to_proto(np.zeros(16, np.float32))
        while not stop.wait(0.05):
            for worker_id in squatters:
                try:
                    stub.Pull(pb.PullRequest(worker_id=worker_id, known_version=-1))
                except grpc.RpcError as error:  # the squatter the newcomer displaced is gone
                    if error.code() != grpc.StatusCode.NOT_FOUND:
                        raise
            version = stub.Status(pb.StatusRequest()).version
            stub.Commit(
                pb.CommitRequest(
                    worker_id=committer, base_version=version, kind=pb.PAYLOAD_KIND_UPDATE, payload=payload
                )
            )

    thread = threading.Thread(target=keep_alive)
    thread.start()
    try:
        with pytest.raises(grpc.RpcError) as full:
            register(stub)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # within the lease: still full
        newcomer = wait_for(lambda: _try_register(stub), timeout=20, what="a place for the newcomer")
    finally:
        stop.set()
        thread.join(30)
    registry = server.server.state.registry
    assert newcomer in registry and committer in registry
    assert sum(worker_id in registry for worker_id in squatters) == 1
    assert "worker evicted" in server.log() and "server full" in server.log()


def _try_register(stub: Any) -> str | None:
    try:
        return str(register(stub).worker_id)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None
