"""--tls-crl on every listener that takes client certificates (issue 61, item 4): a certificate
the CA signed and the operator revoked is refused on the gRPC port, the data plane and the
replication stream (both ends), and a revocation written while the server runs takes effect on
the next call, without a restart."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gemps
from gemps_proto.reasons import METADATA_KEY
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.replication import frames
from gemps_server.replication.credentials import Credential
from gemps_server.replication.handshake import Handshake, Refused
from gemps_server.revocation import RECHECK_SECONDS, revocations_for
from gemps_server.security import tls_context
from tests.data_plane_client import DataPlaneClient
from tests.helpers import InProcessServer, wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_data_plane_hostile import refusals
from tests.integration.test_data_plane_tls import client_context
from tests.integration.test_security import tls_channel
from tests.pki import Authority, Issued

P = 16


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def mutual(ca: Authority, server: Issued, crl: Path) -> dict[str, object]:
    return {"tls_cert": server.cert, "tls_key": server.key, "tls_client_ca": ca.ca.cert, "tls_crl": crl}


def register(server: InProcessServer, ca: Authority, client: Issued) -> pb.RegisterResponse:
    stub = pb_grpc.ParameterServerStub(tls_channel(server.target, ca.ca.cert, client))
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    request = pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(P, np.float32)))
    reply: pb.RegisterResponse = stub.Register(request, timeout=10)
    return reply


def test_grpc_refuses_a_revoked_client_and_a_new_revocation_on_its_next_call(
    start_server: StartServer, ca: Authority, tmp_path: Path
) -> None:
    stolen, honest = ca.issue("stolen-worker"), ca.issue("honest-worker")
    crl = ca.revoke(tmp_path / "crl.pem", stolen)
    server = start_server(rule="downpour", **mutual(ca, ca.issue("server", server=True), crl))
    with pytest.raises(grpc.RpcError) as refused:
        register(server, ca, stolen)
    error: Any = refused.value  # a grpc.Call too
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "CN=stolen-worker" in error.details() and "revoked" in error.details()
    trailing: dict[str, str] = dict(error.trailing_metadata() or ())
    assert trailing[METADATA_KEY] == "revoked_certificate"
    assert server.server.state.core.version == 0 and len(server.server.state.core.registry) == 0  # nothing taken
    channel = tls_channel(server.target, ca.ca.cert, honest)
    stub = pb_grpc.ParameterServerStub(channel)
    assert stub.Status(pb.StatusRequest(), timeout=10) is not None
    ca.revoke(crl, stolen, honest)  # the operator revokes the honest one's too, the server running

    def refused_now() -> bool:
        try:
            stub.Status(pb.StatusRequest(), timeout=10)  # the same channel: its connection is open
        except grpc.RpcError as failed:
            return failed.code() == grpc.StatusCode.UNAUTHENTICATED
        return False

    wait_for(refused_now, timeout=10 * RECHECK_SECONDS, what="the new revocation in force")


def test_the_sdk_is_told_why(start_server: StartServer, ca: Authority, tmp_path: Path) -> None:
    stolen = ca.issue("stolen-sdk")
    server = start_server(
        rule="downpour", **mutual(ca, ca.issue("server", server=True), ca.revoke(tmp_path / "c", stolen))
    )
    client = gemps.Client(
        server.target, ca_cert=str(ca.ca.cert), client_cert=str(stolen.cert), client_key=str(stolen.key),
        retry=gemps.RetryPolicy(max_attempts=1),
    )  # fmt: skip
    with pytest.raises(gemps.GempsError, match="revoked"):
        client.register({"w": np.zeros(P, np.float32)})
    client.close()


def test_the_data_plane_closes_a_revoked_certificate_after_its_handshake(
    start_server: StartServer, ca: Authority, tmp_path: Path
) -> None:
    honest, stolen = ca.issue("data-honest"), ca.issue("data-stolen")
    crl = ca.revoke(tmp_path / "crl.pem", stolen)
    server = start_server(
        rule="downpour", data_plane_hello_timeout=2.0, **mutual(ca, ca.issue("server", server=True), crl)
    )
    reply = register(server, ca, honest)
    port = reply.data_plane.port
    with DataPlaneClient(port, tls=client_context(ca.ca, honest)) as client:
        client.hello(reply.worker_id, reply.data_plane.ticket)
        client.commit(reply.worker_id, np.ones(P, np.float32), 0)
    assert server.server.state.core.version == 1
    with (
        pytest.raises((ssl.SSLError, ConnectionError)),
        DataPlaneClient(port, tls=client_context(ca.ca, stolen)) as bad,
    ):
        bad.hello(reply.worker_id, reply.data_plane.ticket)  # the worker's own ticket, a revoked certificate
    wait_for(lambda: refusals(server)["revoked_certificate"] == 1, timeout=10, what="the refusal counted")
    assert refusals(server)["tls"] == 0


def test_a_replica_refuses_a_revoked_peer_on_the_replication_stream(ca: Authority, tmp_path: Path) -> None:
    """Both ends: a primary refuses a backup with a revoked certificate (and tells it why), and a
    backup refuses a primary presenting one; the handshake is the replicas' own, over real TLS."""
    primary_cert, stolen = ca.issue("replica-0", server=True), ca.issue("replica-1")
    crl = ca.revoke(tmp_path / "crl.pem", stolen)
    revocations = revocations_for(str(crl), str(ca.ca.cert))

    def credential(own: Issued) -> Credential:
        server = tls_context(str(own.cert), str(own.key), str(ca.ca.cert))
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_cert_chain(own.cert, own.key)
        client.load_verify_locations(cafile=str(ca.ca.cert))
        client.check_hostname = False
        return Credential(b"k" * 32, server, client, str(own.cert), None, revocations, own.cert.read_bytes())

    def handshake_between(primary: Issued, backup: Issued) -> tuple[BaseException | None, BaseException | None]:
        listener = socket.create_server(("127.0.0.1", 0))
        outcome: list[BaseException | None] = [None]

        def admit() -> None:  # the primary's door (replication/door.py, without its places), then its handshake
            sock, _ = listener.accept()
            try:
                handshake = Handshake(credential(primary), 0, 2)
                sock.settimeout(5)
                name, _ = handshake.admission(
                    sock.recv(frames.PREAMBLE.size, socket.MSG_WAITALL), "a", "partition-0-replica-0"
                )
                sock.sendall(frames.DOOR_OPEN)
                handshake.admit(
                    sock, "partition-0-replica-0", "a", 1, b"t" * 32, time.monotonic() + 5, lambda hello: "", name
                )
            except BaseException as error:  # what the primary's side ended with
                outcome[0] = error

        thread = threading.Thread(target=admit)
        thread.start()
        hello = {"name": "partition-0-replica-1", "incarnation": "i", "address": "b", "replication": "c"}
        joined: BaseException | None = None
        try:
            sock = socket.create_connection(listener.getsockname(), timeout=5)
            Handshake(credential(backup), 0, 2).join(sock, hello, 1, "partition-0-replica-0", "a", time.monotonic() + 5)
        except BaseException as error:
            joined = error
        thread.join(10)
        listener.close()
        return outcome[0], joined

    at_primary, at_backup = handshake_between(primary_cert, stolen)
    assert isinstance(at_primary, Refused) and "backup's certificate CN=replica-1" in str(at_primary)
    assert isinstance(at_backup, Refused) and "refused by the primary" in str(at_backup) and "revoked" in str(at_backup)
    ca.revoke(crl, primary_cert)  # now the primary's certificate is the revoked one
    time.sleep(RECHECK_SECONDS)
    _, at_backup = handshake_between(primary_cert, ca.issue("replica-1b"))
    assert isinstance(at_backup, Refused) and "the primary's certificate CN=replica-0" in str(at_backup)
    assert credential(primary_cert).unfit().startswith("its own certificate CN=replica-0")  # it does not campaign
    assert credential(stolen).unfit() == ""


def test_a_bad_list_refuses_the_start_naming_it(ca: Authority, tmp_path: Path) -> None:
    (tmp_path / "crl.pem").write_text("not a list\n")
    server = ca.issue("server", server=True)
    argv = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca.ca.cert)]
    done = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "server", "--port", "0", "--metrics-port", "-1", *argv,
         "--tls-crl", str(tmp_path / "crl.pem")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "not a certificate revocation list" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_every_kind_of_call_of_a_certificate_not_revoked_goes_through(
    start_server: StartServer, ca: Authority, tmp_path: Path
) -> None:
    """The guard wraps each handler whatever its shape: the streamed register, commit and pull of an
    honest worker (gRPC only, in pieces), and the health Watch stream, pass it."""
    honest, stolen = ca.issue("streaming-honest"), ca.issue("streaming-stolen")
    crl = ca.revoke(tmp_path / "crl.pem", stolen)
    server = start_server(rule="downpour", **mutual(ca, ca.issue("server", server=True), crl))
    with gemps.Client(
        server.target, plane="grpc", streaming="always",
        ca_cert=str(ca.ca.cert), client_cert=str(honest.cert), client_key=str(honest.key),
    ) as client:  # fmt: skip
        client.register({"w": np.zeros(P, np.float32)})
        assert client.commit(np.ones(P, np.float32), kind="update").version == 1
        assert client.pull().flat[0] == 1.0
    watch = health_pb2_grpc.HealthStub(tls_channel(server.target, ca.ca.cert, honest)).Watch(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    assert next(iter(watch)).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
