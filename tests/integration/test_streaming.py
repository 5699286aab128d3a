"""CommitStream and the bfloat16 wire format on a real server: same results as unary float32
commits, and every malformed stream refused with INVALID_ARGUMENT before theta is touched."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.grpc_framing import data_frames, frame_data
from gemps_proto.tensor_codec import bfloat16_to_float32, float32_to_bfloat16
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.helpers import InProcessServer, scrape_series
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
    assert stub.Status(pb.StatusRequest()).commits_rejected == 1  # counted as a rejected commit
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    rejected = [value for name, value in series.items() if name.startswith('gemps_commits_total{outcome="rejected"')]
    assert sum(rejected) == 1  # ... in the metrics too
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


def test_large_models_register_without_theta_and_pull_it_in_pieces(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the streaming threshold a later worker's Register reply leaves θ out (n registering
    at once would hold n copies) and θ comes by PullStream, in pieces: the same values as Pull."""
    monkeypatch.setattr(gemps.grpc_transport, "STREAM_THRESHOLD_BYTES", 65_536)  # P floats are 1.2 MB
    server = start_server(rule="downpour", learning_rate=0.5)
    gradient = np.random.default_rng(2).standard_normal(P, dtype=np.float32)
    with (
        gemps.Client(server.target, chunk_bytes=65_536) as first,
        gemps.Client(server.target, chunk_bytes=65_536) as later,
        gemps.Client(server.target, wire_dtype="bfloat16") as rounded,
        gemps.Client(server.target, streaming="never") as unary,
    ):
        assert first.register({"theta": np.zeros(P, np.float32)}).initialized_central
        theta = first.commit(gradient).parameters.flat
        sent = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert sent['gemps_sent_bytes_total{method="PullStream",plane="grpc"}'] == 0  # its own values: nothing to read

        registration = later.register({"theta": np.ones(P, np.float32)})
        assert registration.version == 1 and not registration.initialized_central and later.central is not None
        np.testing.assert_array_equal(later.central.flat, theta)
        rounded.register({"theta": np.ones(P, np.float32)})
        assert rounded.central is not None
        np.testing.assert_array_equal(rounded.central.flat, bfloat16_to_float32(float32_to_bfloat16(theta)))
        unary.register({"theta": np.ones(P, np.float32)})
        assert later.pull() is later.central  # current: the header says unchanged, no data follows

        sent = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        # θ went out by PullStream (float32 once, bfloat16 once, plus the pieces' framing) ...
        assert 6 * P <= sent['gemps_sent_bytes_total{method="PullStream",plane="grpc"}'] < 6 * P + 4096
        # ... and by Register only to the worker that did not stream: the others' replies were small.
        assert 4 * P <= sent['gemps_sent_bytes_total{method="Register",plane="grpc"}'] < 4 * P + 4096


def test_large_models_starting_together_upload_theta_once(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six workers of a large model registering at once against a fresh server: one sends its
    initial values, the others wait for it (retrying) and read θ by PullStream; all hold it."""
    monkeypatch.setattr(gemps.grpc_transport, "STREAM_THRESHOLD_BYTES", 65_536)
    server = start_server()
    clients = [gemps.Client(server.target, chunk_bytes=65_536) for _ in range(6)]
    values = [np.full(P, float(i), np.float32) for i in range(6)]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(lambda c, v: c.register({"theta": v}), clients, values))
        thetas = [c.central.flat for c in clients if c.central is not None]
        assert len(thetas) == 6 and all(np.array_equal(t, thetas[0]) for t in thetas)
        assert any(np.array_equal(thetas[0], v) for v in values)
        received = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        streamed = received['gemps_received_bytes_total{method="RegisterStream",plane="grpc"}']
        assert (
            4 * P <= received['gemps_received_bytes_total{method="Register",plane="grpc"}'] + streamed < 5 * P
        )  # one upload
        assert streamed >= 4 * P  # in pieces: each message well under the server's --max-message-mb
    finally:
        for client in clients:
            client.close()
