"""Versions between the SDK and the server (issue 49, item 3): Register and Status carry the
server's software and protocol versions, each end refuses a peer it shares no protocol with,
naming both, and a peer from before versions (none sent) keeps working. A checkpoint of a newer
format stops the server at start; one of the first format is served."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from gemps_cli.main import main as gemps_main

import gemps
from gemps_proto import reasons, versions
from gemps_proto import schema_proto as shared
from gemps_proto.schema import Shard, TrainingConfig
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import CORRUPT_SUFFIX, FORMAT_VERSION
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer
from tests.integration.conftest import SPEC, StartServer, open_stub, register
from tests.unit.test_checkpoint_formats import THETA, first_format_checkpoint

PARAMS = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
# A client or server of the future: it speaks protocols 5 to 7 only.
FUTURE = pb.Versions(software="9.0.0", protocol=7, oldest_protocol=5)


def reason_of(error: grpc.RpcError) -> str:
    assert isinstance(error, grpc.Call)
    return next((str(v) for k, v in error.trailing_metadata() or () if k == reasons.METADATA_KEY), "")


def test_register_and_status_carry_the_servers_versions(server: InProcessServer) -> None:
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        registration = client.registration
        assert registration is not None and registration.versions == versions.THIS
        assert client.status().versions == versions.THIS
    assert versions.THIS.software == gemps.__version__
    assert f"gemps_version={gemps.__version__}" in server.log()  # the serving line names it


def test_the_server_refuses_a_client_it_shares_no_protocol_with(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    initial = shared.tensor_to_proto(np.zeros(16, np.float32))
    unary = pb.RegisterRequest(spec=SPEC, initial_parameters=initial, versions=FUTURE)
    streamed = [pb.RegisterChunk(header=pb.RegisterRequest(spec=SPEC, versions=FUTURE))]
    for call in (lambda: stub.Register(unary), lambda: stub.RegisterStream(iter(streamed))):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason_of(refused.value) == reasons.Reason.INCOMPATIBLE_VERSION
        details = refused.value.details() or ""
        assert f"server gemps {versions.SOFTWARE_VERSION} (protocol {versions.PROTOCOL_VERSION})" in details
        assert "client gemps 9.0.0 (protocols 5-7)" in details
    status = stub.Status(pb.StatusRequest())
    assert not status.initialized and status.active_workers == 0  # θ untouched, nobody registered


def test_a_clients_software_string_is_cut_before_it_is_repeated(server: InProcessServer) -> None:
    claimed = pb.Versions(software="9\n" + "x" * 100_000, protocol=7, oldest_protocol=7)
    with pytest.raises(grpc.RpcError) as refused:
        open_stub(server.target).Register(pb.RegisterRequest(spec=SPEC, versions=claimed))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert "\n" not in details and len(details) < 400
    assert f"client gemps 9?{'x' * (versions.MAX_SOFTWARE_LENGTH - 2)} (protocol 7)" in details


def test_a_client_from_before_versions_still_registers(server: InProcessServer) -> None:
    reply = register(open_stub(server.target))  # sends no versions: the legacy protocol
    assert reply.worker_id and reply.initialized_central
    assert reply.versions.protocol == versions.PROTOCOL_VERSION


class FutureServer:
    """A real gRPC server on a real port answering as a gemps of the future (`answers_versions`)
    or of the past (None): Register, Leave and Status, enough for the SDK to judge it."""

    def __init__(self, answers_versions: pb.Versions | None) -> None:
        self.left: list[str] = []
        self._versions = answers_versions
        handlers = {
            "Register": self._unary(pb.RegisterRequest, self._register),
            "Leave": self._unary(pb.LeaveRequest, self._leave),
            "Status": self._unary(pb.StatusRequest, self._status),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("gemps.v1.ParameterServer", handlers)]
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @staticmethod
    def _unary(request: Any, behaviour: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=request.FromString,
            response_serializer=lambda reply: reply.SerializeToString(),
        )

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        reply = pb.RegisterResponse(
            worker_id="w-future",
            lease_ttl_seconds=60.0,
            config=shared.training_config_to_proto(TrainingConfig()),
            shard=shared.shard_to_proto(Shard(0, 1)),
            initialized_central=True,
        )
        if self._versions is not None:
            reply.versions.CopyFrom(self._versions)
        return reply

    def _leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self.left.append(request.worker_id)
        return pb.LeaveResponse()

    def _status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        reply = pb.StatusResponse(config=shared.training_config_to_proto(TrainingConfig()))
        if self._versions is not None:
            reply.versions.CopyFrom(self._versions)
        return reply

    def stop(self) -> None:
        self._server.stop(grace=None)


@pytest.fixture
def future_server() -> Iterator[FutureServer]:
    server = FutureServer(FUTURE)
    yield server
    server.stop()


def test_the_sdk_refuses_a_server_it_shares_no_protocol_with(future_server: FutureServer) -> None:
    target = f"127.0.0.1:{future_server.port}"
    expected = re.escape(
        f"server gemps 9.0.0 (protocols 5-7), client gemps {versions.SOFTWARE_VERSION} "
        f"(protocol {versions.PROTOCOL_VERSION}); upgrade the client"
    )
    with gemps.Client(target, streaming="never") as client:
        with pytest.raises(gemps.IncompatibleVersionError, match=expected) as refused:
            client.register(PARAMS)
        assert refused.value.reason == reasons.Reason.INCOMPATIBLE_VERSION
        assert future_server.left == ["w-future"]  # the registration it made is given back
        with pytest.raises(gemps.IncompatibleVersionError, match=expected):
            client.status()


def test_the_sdk_talks_to_a_server_from_before_versions() -> None:
    old = FutureServer(None)
    try:
        with gemps.Client(f"127.0.0.1:{old.port}") as client:
            assert client.status().versions is None  # not said: the legacy protocol, which this SDK speaks
    finally:
        old.stop()


def test_gemps_status_names_the_servers_version(server: InProcessServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert gemps_main(["status", "--server", server.target]) == 0
    out = capsys.readouterr().out
    assert f"software        gemps {versions.SOFTWARE_VERSION} (protocol {versions.PROTOCOL_VERSION})" in out


def test_a_checkpoint_of_a_newer_format_stops_the_server_at_start(tmp_path: Path) -> None:
    """What a rollback after an upgrade meets: exit 2 and one line naming both formats, the file
    kept under its name, rather than a server that serves from version 0."""
    newer = first_format_checkpoint(tmp_path / "ckpt", 9, format_version=str(int(FORMAT_VERSION) + 1))
    server = ServerProcess(checkpoint_dir=tmp_path / "ckpt")
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            server.start()
        log = server.log()
    finally:
        server.close()
    refusals = [line for line in log.splitlines() if "cannot start" in line]
    assert len(refusals) == 1, log
    assert f"format version {int(FORMAT_VERSION) + 1} (written by gemps 9.0.0)" in refusals[0]
    assert f"newer than this server's {FORMAT_VERSION} (gemps {versions.SOFTWARE_VERSION})" in refusals[0]
    assert newer.exists() and not list(newer.parent.glob(f"*{CORRUPT_SUFFIX}"))


def test_a_checkpoint_of_the_first_format_is_served(tmp_path: Path, start_server: StartServer) -> None:
    first_format_checkpoint(tmp_path / "ckpt", 12)
    server = start_server(checkpoint_dir=str(tmp_path / "ckpt"))
    with gemps.Client(server.target) as observer:
        central = observer.pull()
    assert central.version == 12
    np.testing.assert_array_equal(central.flat, THETA)
