"""Slow-drip streams cannot starve honest workers (issue 28, item 3), against real server processes.

A RegisterStream holds the one upload of initial values, a CommitStream one of the
--max-streamed-payloads buffers. The idle timeout was per piece, so a client sending 4 bytes every
half of it held them for as long as it liked: an honest first worker, or an honest streamed
commit, waited until it failed. Now a stream must also move, on average, at least
--min-stream-rate-mb (the data plane's floor: one option for both planes), with the idle timeout
as slack, and streams wait their turn for the upload or a buffer in arrival order. The attacker
here opens a new dripping stream each time one is cut off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess
from tests.helpers import scrape_series, wait_for

pytestmark = pytest.mark.timeout(180)

P = 300_000  # 1.2 MB of float32: the SDK streams it (past 1 MiB)
IDLE = 2.0  # --stream-idle-timeout
DRIP_SECONDS = IDLE / 4  # 4 bytes this often: well inside the idle timeout
HONEST = gemps.RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=0.5)
Chunk = pb.RegisterChunk | pb.CommitChunk


class Dripper:
    """Streams that send a header and then 4 bytes every DRIP_SECONDS, forever, opened one after
    another (a new one each time the server ends one) until `stop()`; `ended` holds how each ended."""

    def __init__(self, open_stream: Callable[[Iterator[Any]], object], header: Chunk, piece: Chunk) -> None:
        self._open, self._header, self._piece = open_stream, header, piece
        self._stop = threading.Event()
        self.ended: list[tuple[grpc.StatusCode, str]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Dripper:
        self._thread.start()
        return self

    def _chunks(self) -> Iterator[Chunk]:
        yield self._header
        while not self._stop.wait(DRIP_SECONDS):
            yield self._piece

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._open(self._chunks())
                self.ended.append((grpc.StatusCode.OK, ""))
            except grpc.RpcError as error:
                assert isinstance(error, grpc.Call)
                reason = dict(error.trailing_metadata() or ()).get("gemps-reason", "")
                self.ended.append((error.code(), str(reason)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def received(server: ServerProcess, method: str) -> float:
    series = f'gemps_received_bytes_total{{method="{method}",plane="grpc"}}'
    return scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics").get(series, 0.0)


def test_a_dripping_upload_cannot_keep_the_first_worker_out() -> None:
    with ServerProcess(stream_idle_timeout=IDLE) as server, grpc.insecure_channel(server.target) as channel:
        header = pb.RegisterChunk(
            header=pb.RegisterRequest(
                spec=[pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)],
                initial_parameters=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[P]),
                omit_parameters=True,
            )
        )
        stub = pb_grpc.ParameterServerStub(channel)
        attacker = Dripper(
            lambda chunks: stub.RegisterStream(chunks, timeout=600), header, pb.RegisterChunk(data=bytes(4))
        )
        attacker.start()
        try:  # the attacker holds the upload once the server has read its header and a first piece
            wait_for(lambda: received(server, "RegisterStream") > header.ByteSize() + 4, 30, "the drip to begin")
            values = np.linspace(-1, 1, P, dtype=np.float32)
            with gemps.Client(server.target, timeout=30, retry=HONEST, plane="grpc") as honest:
                registration = honest.register({"w": values})
                assert registration.initialized_central  # its values became θ, not the attacker's
                assert honest.central is not None
                np.testing.assert_array_equal(honest.central.flat, values)
        finally:
            attacker.stop()
    assert attacker.ended, "the server never ended a dripping upload"
    assert attacker.ended[0] == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.STREAM_IDLE.value)


def test_a_dripping_commit_stream_cannot_keep_honest_commits_out() -> None:
    with (
        ServerProcess(stream_idle_timeout=IDLE, max_streamed_payloads=1, rule="downpour") as server,
        gemps.Client(server.target, timeout=30, retry=HONEST, plane="grpc") as honest,
        grpc.insecure_channel(server.target) as channel,
    ):
        honest.register({"w": np.zeros(P, np.float32)})
        stub = pb_grpc.ParameterServerStub(channel)
        worker = stub.Register(
            pb.RegisterRequest(
                spec=[pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)], omit_parameters=True
            )
        ).worker_id
        header = pb.CommitChunk(
            header=pb.CommitRequest(
                worker_id=worker,
                base_version=0,
                kind=pb.PAYLOAD_KIND_UPDATE,
                payload=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[P]),
            )
        )

        def commit_stream(chunks: Iterator[pb.CommitChunk]) -> None:
            for _reply in stub.CommitStream(chunks, timeout=600):
                pass

        attacker = Dripper(commit_stream, header, pb.CommitChunk(data=bytes(4)))
        attacker.start()
        try:  # the attacker holds the one buffer once the server has read its header and a piece
            wait_for(lambda: received(server, "CommitStream") > header.ByteSize() + 4, 30, "the drip to begin")
            for step in range(3):  # each waits its turn behind at most one dripping stream
                result = honest.commit(np.ones(P, np.float32), kind="update")
                assert result.version == step + 1
        finally:
            attacker.stop()
        theta = honest.pull().flat
    np.testing.assert_array_equal(theta, np.full(P, 3, np.float32))  # no byte of the attacker's was applied
    assert attacker.ended, "the server never ended a dripping commit"
    assert attacker.ended[0] == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.STREAM_IDLE.value)
