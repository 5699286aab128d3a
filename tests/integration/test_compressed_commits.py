"""Compressed commits (issue 47, items 1-2) on real servers: `Client(compression="int8" | "int4")`
sends each commit in blockwise codes, and with the residual it keeps (error feedback) the server
receives every update's sum, on every route; a retried commit is the same bytes, applied once; a
payload no encoder writes is refused on every path and touches nothing."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto import block_quantisation, block_topk
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.reasons import METADATA_KEY
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.tensor_codec import COMPRESSIONS as DTYPES
from gemps_proto.tensor_codec import INT4_BLOCK, INT8_BLOCK, TOPK_BLOCK, encode_payload, expected_payload_nbytes
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from tests.data_plane_client import DataPlaneClient
from tests.helpers import scrape_series, start_partitions, stop_process
from tests.integration.conftest import StartServer, open_stub
from tests.integration.test_replicas import commit_until_backup_matches, replica_options

P = 3 * block_quantisation.BLOCK + 5  # several blocks, the last one short, an odd count (int4's padding)
COMPRESSIONS = ["int8", "int4", "topk"]


def updates(count: int, size: int = P, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * rng.choice([1e-3, 1.0], size)).astype(np.float32) for _ in range(count)]


def residual_of(client: gemps.Client, server: int = 0) -> np.ndarray:
    compressor = client._router.compressor
    assert compressor is not None
    found = compressor.residual(server)
    assert found is not None
    return found


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_the_server_receives_every_update_but_what_the_client_still_holds(
    start_server: StartServer, compression: str
) -> None:
    """DOWNPOUR adds what it receives: theta = the updates' sum less the client's residual, to
    float32's rounding, on each route (the plane fixture: shared memory, TCP, gRPC)."""
    server = start_server(rule="downpour")
    with gemps.Client(server.target, compression=compression) as client:
        client.register({"w": np.zeros(P, np.float32)})
        sent = updates(12)
        for update in sent:
            client.commit(update, kind="update")
        theta = client.pull().flat
        residual = residual_of(client)
    total = np.sum(sent, axis=0, dtype=np.float64)
    np.testing.assert_allclose(theta, total - residual, atol=2e-5)
    if compression == "topk":  # what each block left out: most values, some kept back since the first commit
        assert np.count_nonzero(residual) > P // 2
    else:
        levels = block_quantisation.INT8_LEVELS if compression == "int8" else block_quantisation.INT4_LEVELS
        assert np.abs(residual).max() <= np.abs(total).max() / levels  # at most half a code's step of the last sum
    assert np.abs(residual).max() > 0  # the codes did round something away


def test_a_streamed_commit_is_compressed_too(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target, compression="int8", plane="grpc", streaming="always", chunk_bytes=100) as client:
        client.register({"w": np.zeros(P, np.float32)})
        update = updates(1)[0]
        client.commit(update, kind="update")
        np.testing.assert_allclose(client.pull().flat, update - residual_of(client), atol=1e-6)


def commit_bytes(server_metrics_port: int) -> float:
    """Bytes the server received in Commit requests over gRPC (gemps_received_bytes_total)."""
    found = scrape_series(f"http://127.0.0.1:{server_metrics_port}/metrics")
    return found['gemps_received_bytes_total{method="Commit",plane="grpc"}']


@pytest.mark.parametrize(("compression", "fewer"), [("int8", 3.9), ("int4", 7.5), ("topk", 25.0)])
def test_a_commit_is_a_quarter_an_eighth_or_a_28th_of_float32s_bytes(
    start_server: StartServer, compression: str, fewer: float
) -> None:
    size = 100_000
    sent = []
    for chosen in (None, compression):
        server = start_server(rule="downpour")
        with gemps.Client(server.target, compression=chosen, plane="grpc") as client:
            client.register({"w": np.zeros(size, np.float32)})
            for update in updates(3, size):
                client.commit(update, kind="update")
        sent.append(commit_bytes(server.metrics_port))
        series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        encoding = chosen or "float32"
        expected = 3 * (4 * size if chosen is None else expected_payload_nbytes(DTYPES[chosen], [size]))
        assert series[f'gemps_wire_bytes_total{{direction="received",encoding="{encoding}"}}'] == expected
        assert series['gemps_wire_bytes_total{direction="sent",encoding="float32"}'] >= 3 * 4 * size  # the replies
    assert sent[0] / sent[1] >= fewer, sent


def test_partitions_each_keep_their_residual(start_server: StartServer) -> None:
    servers = start_partitions(start_server, 2, rule="downpour")
    with gemps.Client(servers[0].target, compression="int4") as client:
        client.register({"w": np.zeros(P, np.float32)})
        sent = updates(6)
        for update in sent:
            client.commit(update, kind="update")
        theta = client.pull().flat
        residual = np.concatenate([residual_of(client, 0), residual_of(client, 1)])
    np.testing.assert_allclose(theta, np.sum(sent, axis=0, dtype=np.float64) - residual, atol=2e-5)


def test_registering_again_forgets_the_residual(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target, compression="int8") as client:
        client.register({"w": np.zeros(P, np.float32)})
        client.commit(updates(1)[0], kind="update")
        assert np.abs(residual_of(client)).max() > 0
        client.leave()
        client.register({"w": np.zeros(P, np.float32)})
        assert client._router.compressor is not None and client._router.compressor.residual(0) is None


def commit_across_a_pause(server: ServerProcess, client: gemps.Client, update: np.ndarray) -> gemps.CommitResult:
    """`update` committed while the server is paused (SIGSTOP for 2 s): its attempt times out and
    is sent again (asserted), both reaching the server once it resumes."""
    stop_process(server.pid)
    resume = threading.Timer(2.0, os.kill, (server.pid, signal.SIGCONT))
    resume.start()
    try:
        retries = client.retries
        result = client.commit(update, kind="update")
    finally:
        resume.join()
    assert client.retries > retries  # it was retried
    return result


def test_a_retried_commit_sends_the_same_bytes_and_is_applied_once() -> None:
    """The server is paused (SIGSTOP) while a commit goes out: its attempt times out and is sent
    again; both arrive when it resumes, and the ledger applies one. theta still equals the sum less
    the residual: the residual the client kept is the one of the bytes applied (encoded once)."""
    with ServerProcess(rule="downpour", log_level="warning") as server:
        client = gemps.Client(server.target, compression="int8", plane="grpc", attempt_timeout=0.5, timeout=60)
        client.register({"w": np.zeros(P, np.float32)})
        first, second = updates(2)
        client.commit(first, kind="update")
        result = commit_across_a_pause(server, client, second)
        assert result.version == 2  # applied once
        np.testing.assert_allclose(client.pull().flat, first + second - residual_of(client), atol=2e-5)
        client.close()


# -- hostile encodings on every path ------------------------------------------------------------


VALUES = updates(1)[0]


def hostile_payloads() -> dict[str, tuple[int, bytes]]:
    int8, int4 = bytearray(encode_payload(VALUES, INT8_BLOCK)), bytearray(encode_payload(VALUES, INT4_BLOCK))
    topk = bytearray(encode_payload(VALUES, TOPK_BLOCK))
    scales = 4 * block_quantisation.blocks(P)
    cases = {}
    for name, (dtype, good) in {
        "int8": (INT8_BLOCK, int8),
        "int4": (INT4_BLOCK, int4),
        "topk": (TOPK_BLOCK, topk),
    }.items():
        nan_scale, negative_scale = bytearray(good), bytearray(good)
        nan_scale[0:4] = np.float32(np.nan).tobytes()
        negative_scale[4:8] = np.float32(-1.0).tobytes()
        cases[f"{name}-nan-scale"] = (dtype, bytes(nan_scale))
        cases[f"{name}-negative-scale"] = (dtype, bytes(negative_scale))
        cases[f"{name}-short"] = (dtype, bytes(good[:-1]))
        cases[f"{name}-long"] = (dtype, bytes(good) + b"\0")
    minus_128 = bytearray(int8)
    minus_128[scales + 7] = 0x80
    cases["int8-code-minus-128"] = (INT8_BLOCK, bytes(minus_128))
    minus_8 = bytearray(int4)
    minus_8[scales + 3] = (minus_8[scales + 3] & 0x0F) | 0x80
    cases["int4-code-minus-8"] = (INT4_BLOCK, bytes(minus_8))
    padding = bytearray(int4)
    padding[-1] |= 0x10  # P is odd: the last byte's high nibble is padding
    cases["int4-padding-set"] = (INT4_BLOCK, bytes(padding))
    kept = block_topk.kept(P)
    topk_minus_128 = bytearray(topk)
    topk_minus_128[scales + kept + 2] = 0x80
    cases["topk-code-minus-128"] = (TOPK_BLOCK, bytes(topk_minus_128))
    past_the_end = bytearray(topk)
    past_the_end[scales + kept - 1] = 5  # P's last block holds 5 values: indices 0-4
    cases["topk-index-past-the-end"] = (TOPK_BLOCK, bytes(past_the_end))
    repeated = bytearray(topk)
    repeated[scales + 1] = repeated[scales]
    cases["topk-index-repeated"] = (TOPK_BLOCK, bytes(repeated))
    return cases


HOSTILE = hostile_payloads()


def register(stub: pb_grpc.ParameterServerStub) -> pb.RegisterResponse:
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    return stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(P, np.float32))))


def refused_by_grpc(stub: pb_grpc.ParameterServerStub, request: pb.CommitRequest, streamed: bool) -> tuple[str, str]:
    try:
        if streamed:
            data, request.payload.data = request.payload.data, b""
            chunks = [pb.CommitChunk(header=request), pb.CommitChunk(data=data)]
            list(stub.CommitStream(iter(chunks)))
        else:
            stub.Commit(request)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return error.code().name, dict(error.trailing_metadata() or ()).get(METADATA_KEY, "")
    return "OK", ""


@pytest.mark.parametrize("route", ["unary", "stream", "data-plane"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_payload_no_encoder_writes_is_refused_and_touches_nothing(
    start_server: StartServer, route: str, case: str
) -> None:
    server = start_server(rule="downpour")
    stub = open_stub(server.target)
    registration = register(stub)
    dtype, data = HOSTILE[case]
    assert send(route, stub, registration, dtype, data) == ("INVALID_ARGUMENT", "bad_payload"), case
    pulled = stub.Pull(pb.PullRequest(known_version=-1))
    assert pulled.version == 0 and not np.frombuffer(pulled.parameters.data, np.float32).any()
    # The same route takes the same dtype's bytes as the encoder writes them: the refusal was the bytes'.
    assert send(route, stub, registration, dtype, encode_payload(VALUES, dtype)) == ("OK", "")
    assert stub.Pull(pb.PullRequest(known_version=-1)).version == 1


def send(
    route: str, stub: pb_grpc.ParameterServerStub, registration: pb.RegisterResponse, dtype: int, data: bytes
) -> tuple[str, str]:
    """An update commit of `data` in `dtype` on `route`: ("OK", "") or its status code's name and reason."""
    request = pb.CommitRequest(
        worker_id=registration.worker_id,
        base_version=0,
        kind=pb.PAYLOAD_KIND_UPDATE,
        payload=pb.Tensor(dtype=dtype, shape=[P], data=data),  # type: ignore[arg-type]
    )
    if route != "data-plane":
        return refused_by_grpc(stub, request, streamed=route == "stream")
    with DataPlaneClient(registration.data_plane.port) as plane:
        assert plane.hello(registration.worker_id, registration.data_plane.ticket).op == Op.HELLO | REPLY
        header = pb.CommitRequest()
        header.CopyFrom(request)
        header.payload.data = b""
        plane.send(Op.COMMIT, header.SerializeToString(), data)
        frame = plane.receive()
    if frame.error is None:
        return "OK", ""
    return next(c.name for c in grpc.StatusCode if c.value[0] == frame.error.code), frame.error.reason


def test_theta_and_replies_never_travel_in_codes(start_server: StartServer) -> None:
    """The codes are for commit payloads: an initial theta in them, or a reply asked in them, is refused."""
    server = start_server(rule="downpour")
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    initial = pb.Tensor(dtype=INT8_BLOCK, shape=[P], data=encode_payload(np.ones(P, np.float32), INT8_BLOCK))  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=initial))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    registration = register(stub)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Pull(pb.PullRequest(worker_id=registration.worker_id, known_version=-1, reply_dtype=INT8_BLOCK))  # type: ignore[arg-type]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Top-k is for commits alone (a reply is the sum of every worker's updates: dense), both ends say so.
    request = pb.CommitRequest(
        worker_id=registration.worker_id,
        base_version=0,
        kind=pb.PAYLOAD_KIND_UPDATE,
        payload=pb.Tensor(dtype=TOPK_BLOCK, shape=[P], data=encode_payload(VALUES, TOPK_BLOCK)),  # type: ignore[arg-type]
        reply_dtype=TOPK_BLOCK,  # type: ignore[arg-type]
    )
    assert refused_by_grpc(stub, request, streamed=False)[0] == "INVALID_ARGUMENT"
    with pytest.raises(ValueError, match="reply_compression must be None or one of int8, int4"):
        gemps.Client(server.target, reply_compression="topk")
    assert stub.Pull(pb.PullRequest(known_version=-1)).version == 0


def test_a_backup_applies_compressed_commits_to_the_same_bits(start_server: StartServer, etcd: LocalEtcd) -> None:
    """The journal carries a commit as the worker sent it, codes and all: the backup decodes the
    same bytes with the same decoder and holds its primary's state bit for bit."""
    servers = [start_server(rule="gem", **replica_options(etcd, index, "compressed")) for index in range(2)]
    target = "|".join(server.target for server in servers)
    clients = [gemps.Client(target, name=f"w{i}", compression=("int8", "int4")[i % 2]) for i in range(2)]
    commit_until_backup_matches(servers, clients, np.zeros(P, np.float32), updates(1)[0], 20)
