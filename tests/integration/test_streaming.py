"""CommitStream and the bfloat16 wire format on a real server: same results as unary float32
commits, and every malformed stream refused with INVALID_ARGUMENT before theta is touched."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.chunks import data_frames, frame_data
from gemps_proto.codec import bfloat16_to_float32, float32_to_bfloat16
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.helpers import InProcessServer
from tests.integration.conftest import NUM_PARAMETERS, StartServer, central, open_stub, register

P = 300_000  # 1.2 MB: several pieces at the default 1 MiB, and at the 64 KiB used below


def _raw(data: bytes) -> bytes:
    return data


def test_streamed_and_unary_commits_move_theta_identically(start_server: StartServer) -> None:
    server = start_server(rule="downpour", learning_rate=0.5)
    gradient = np.random.default_rng(0).standard_normal(P, dtype=np.float32)
    with (
        gemps.Client(server.target, streaming="never") as unary,
        gemps.Client(server.target, streaming="always", chunk_bytes=65_536) as streamed,
    ):
        start = unary.register({"theta": np.zeros(P, np.float32)}).version
        streamed.register({"theta": np.zeros(P, np.float32)})
        first = unary.commit(gradient)
        second = streamed.commit(gradient)
        assert (first.version, second.version) == (start + 1, start + 2)
        assert second.staleness == 1  # its base was the version it registered at
        np.testing.assert_array_equal(first.parameters.flat, -0.5 * gradient)
        np.testing.assert_array_equal(second.parameters.flat, -1.0 * gradient)
        np.testing.assert_array_equal(unary.pull().flat, second.parameters.flat)


def test_bfloat16_wire_format_rounds_both_ways(start_server: StartServer) -> None:
    server = start_server(rule="downpour", learning_rate=1.0)
    gradient = np.random.default_rng(1).standard_normal(P, dtype=np.float32)
    with gemps.Client(server.target, wire_dtype="bfloat16") as client, gemps.Client(server.target) as observer:
        client.register({"theta": np.zeros(P, np.float32)})
        result = client.commit(gradient)
        exact = observer.pull().flat  # float32 on the server: -bf16(g)
        np.testing.assert_array_equal(exact, -bfloat16_to_float32(float32_to_bfloat16(gradient)))
        np.testing.assert_array_equal(result.parameters.flat, bfloat16_to_float32(float32_to_bfloat16(exact)))


def _stream(server: InProcessServer, frames: list[bytes]) -> list[bytes]:
    channel = grpc.insecure_channel(server.target)
    call = channel.stream_stream("/gemps.v1.ParameterServer/CommitStream", _raw, _raw)
    try:
        return list(call(iter(frames), timeout=30))
    finally:
        channel.close()


def _header(worker_id: str, shape: list[int], dtype: int = pb.DTYPE_FLOAT32, base: int = 0) -> bytes:
    request = pb.CommitRequest(
        worker_id=worker_id,
        base_version=base,
        kind=pb.PAYLOAD_KIND_GRADIENT,
        payload=pb.Tensor(dtype=dtype, shape=shape),  # type: ignore[arg-type]
    )
    return pb.CommitChunk(header=request).SerializeToString()


def _good(n: int = NUM_PARAMETERS) -> bytes:
    return np.full(n, 0.5, np.float32).tobytes()


def _bad_streams(worker_id: str) -> Iterator[tuple[str, list[bytes], str]]:
    good = _good()
    yield "data first", [frame_data(good)], "must start with a header"
    yield "too much data", [_header(worker_id, [NUM_PARAMETERS]), *data_frames(good + b"xxxx", 16)], "exceeds"
    yield "too little data", [_header(worker_id, [NUM_PARAMETERS]), frame_data(good[:-4])], "header announced"
    yield "wrong shape", [_header(worker_id, [NUM_PARAMETERS + 1]), frame_data(_good(NUM_PARAMETERS + 1))], "shape"
    nan = np.full(NUM_PARAMETERS, 0.5, np.float32)
    nan[-1] = np.nan
    yield "NaN in the last piece", [_header(worker_id, [NUM_PARAMETERS]), *data_frames(nan.tobytes(), 16)], "NaN"
    yield "two headers", [_header(worker_id, [NUM_PARAMETERS]), _header(worker_id, [NUM_PARAMETERS])], "second header"
    yield "undecodable", [_header(worker_id, [NUM_PARAMETERS]), b"\xff\xff\xff"], "not a valid"
    yield "unknown dtype", [_header(worker_id, [NUM_PARAMETERS], dtype=9), frame_data(good)], "dtype"


@pytest.mark.parametrize("case", [name for name, _, _ in _bad_streams("w")])
def test_malformed_streams_are_refused_and_theta_is_untouched(server: InProcessServer, case: str) -> None:
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    before = central(stub)
    frames, fragment = next((f, m) for name, f, m in _bad_streams(worker_id) if name == case)
    with pytest.raises(grpc.RpcError) as info:
        _stream(server, frames)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert fragment in (info.value.details() or ""), info.value.details()
    assert central(stub) == before
    # Still serving: a good streamed commit goes through.
    replies = _stream(server, [_header(worker_id, [NUM_PARAMETERS], base=before[0]), frame_data(_good())])
    header = pb.CommitResponseChunk.FromString(replies[0]).header
    assert header.version == before[0] + 1


def test_unknown_reply_dtype_is_refused_before_theta_moves(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    before = central(stub)
    request = pb.CommitRequest(
        worker_id=worker_id,
        kind=pb.PAYLOAD_KIND_GRADIENT,
        payload=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[NUM_PARAMETERS], data=_good()),
        reply_dtype=7,  # type: ignore[arg-type]
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reply_dtype" in (info.value.details() or "")
    assert central(stub) == before
