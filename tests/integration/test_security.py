"""The gRPC port is not an open door: bearer tokens, TLS, mutual TLS (certificates generated
here), registration rate limits, and a loud warning for an unprotected listener."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import gemps
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer, register
from tests.pki import Issued, issue, issue_ca

TOKEN = "correct-horse-battery-staple-0123456789"
PARAMS = {"w": np.zeros(4, np.float32)}
NO_RETRY = gemps.RetryPolicy(max_attempts=1)


# -- certificates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Issued
    server: Issued
    client: Issued
    rogue_ca: Issued
    rogue_client: Issued  # signed by a CA the server does not trust


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, ca_signer = issue_ca(directory, "gemps-test-ca")
    rogue_ca, rogue_signer = issue_ca(directory, "rogue-ca")
    return Pki(
        ca=ca,
        server=issue(directory, "server", ca_signer, server=True),
        client=issue(directory, "worker", ca_signer),
        rogue_ca=rogue_ca,
        rogue_client=issue(directory, "intruder", rogue_signer),
    )


# -- helpers ---------------------------------------------------------------------------------------


def status_code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        code: grpc.StatusCode = error.code()
        return code
    return grpc.StatusCode.OK


def tls_channel(target: str, ca: Path | None, client: Issued | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes() if ca else None,
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    return grpc.secure_channel(target, credentials)


def status_over(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    stub = pb_grpc.ParameterServerStub(channel)
    return status_code(lambda: stub.Status(pb.StatusRequest(), timeout=10, metadata=metadata))


# -- bearer token ---------------------------------------------------------------------------------


def test_token_is_required_except_for_health_checks(start_server: StartServer) -> None:
    server = start_server(auth_token=TOKEN)
    channel = grpc.insecure_channel(server.target)
    assert status_over(channel) == grpc.StatusCode.UNAUTHENTICATED
    for wrong in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", TOKEN, f"Basic {TOKEN}", ""):
        assert status_over(channel, (("authorization", wrong),)) == grpc.StatusCode.UNAUTHENTICATED, wrong
    assert status_over(channel, (("authorization", f"Bearer {TOKEN}"),)) == grpc.StatusCode.OK
    # A refused write changes nothing.
    stub = pb_grpc.ParameterServerStub(channel)
    assert status_code(lambda: register(stub)) == grpc.StatusCode.UNAUTHENTICATED
    authorised = stub.Status(pb.StatusRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert not authorised.initialized
    # Health stays open for probes; reflection (a streaming RPC) does not.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    assert status_code(lambda: list(replies)) == grpc.StatusCode.UNAUTHENTICATED
    # Raw bytes to a method that does not exist: refused before anything else.
    raw: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/gemps.v1.ParameterServer/Nope")
    assert status_code(lambda: raw(b"\x00", timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert "unauthenticated" in server.log()


def test_sdk_sends_the_token_from_argument_or_environment(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(auth_token=TOKEN)
    with pytest.raises(gemps.UnauthenticatedError) as info:
        gemps.Client(server.target, retry=NO_RETRY).status()
    assert info.value.reason == "unauthenticated"
    with gemps.Client(server.target, token=TOKEN) as client:
        client.register(PARAMS)
        assert client.commit(np.ones(4, np.float32)).version == 1
    monkeypatch.setenv("GEMPS_AUTH_TOKEN", TOKEN)
    assert gemps.Client(server.target).status().version == 1
    result = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "status", "--server", server.target],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )
    assert result.returncode == 0 and "version         1" in result.stdout, result.stderr


def test_token_from_a_file(start_server: StartServer, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = start_server(auth_token_file=token_file)
    assert gemps.Client(server.target, token=TOKEN).status().version == 0
    with pytest.raises(gemps.UnauthenticatedError):
        gemps.Client(server.target, token="other", retry=NO_RETRY).status()


# -- TLS and mutual TLS -----------------------------------------------------------------------------


def test_tls(start_server: StartServer, pki: Pki) -> None:
    server = start_server(tls_cert=pki.server.cert, tls_key=pki.server.key)
    assert status_over(tls_channel(server.target, pki.ca.cert)) == grpc.StatusCode.OK
    # Plaintext against a TLS port, or a server certificate we cannot verify: no connection.
    assert status_over(grpc.insecure_channel(server.target)) == grpc.StatusCode.UNAVAILABLE
    assert status_over(tls_channel(server.target, pki.rogue_ca.cert)) == grpc.StatusCode.UNAVAILABLE
    with gemps.Client(server.target, ca_cert=str(pki.ca.cert)) as client:
        client.register(PARAMS)
        assert client.commit(np.ones(4, np.float32)).version == 1


def test_mutual_tls_and_token_together(start_server: StartServer, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_server(tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca.cert, auth_token=TOKEN)
    bearer = (("authorization", f"Bearer {TOKEN}"),)
    assert status_over(tls_channel(server.target, pki.ca.cert, pki.client), bearer) == grpc.StatusCode.OK
    # No client certificate, or one from a CA the server does not trust: the handshake fails.
    assert status_over(tls_channel(server.target, pki.ca.cert), bearer) == grpc.StatusCode.UNAVAILABLE
    rogue = tls_channel(server.target, pki.ca.cert, pki.rogue_client)
    assert status_over(rogue, bearer) == grpc.StatusCode.UNAVAILABLE
    # The right certificate without the token is still refused.
    assert status_over(tls_channel(server.target, pki.ca.cert, pki.client)) == grpc.StatusCode.UNAUTHENTICATED
    # The SDK from environment variables alone (as a reference worker in a container).
    for name, value in (
        ("GEMPS_TLS_CA", pki.ca.cert),
        ("GEMPS_TLS_CLIENT_CERT", pki.client.cert),
        ("GEMPS_TLS_CLIENT_KEY", pki.client.key),
        ("GEMPS_AUTH_TOKEN", TOKEN),
    ):
        monkeypatch.setenv(name, str(value))
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        assert client.commit(np.ones(4, np.float32)).version == 1


# -- limits and warnings --------------------------------------------------------------------------------


def test_registrations_per_minute(start_server: StartServer) -> None:
    server = start_server(max_registrations_per_minute=3)
    clients = [gemps.Client(server.target, retry=NO_RETRY) for _ in range(4)]
    for client in clients[:3]:
        client.register(PARAMS)
    with pytest.raises(gemps.ResourceExhaustedError, match="registrations in a minute") as info:
        clients[3].register(PARAMS)
    assert info.value.reason == "registration_rate"
    assert clients[0].commit(np.ones(4, np.float32)).version == 1  # the registered ones carry on
    for client in clients:
        client.close()


@pytest.mark.parametrize(
    "options,warned",
    [({}, True), ({"auth_token": TOKEN}, False)],
    ids=["neither", "token"],
)
def test_warns_loudly_when_listening_beyond_loopback_unprotected(options: dict[str, Any], warned: bool) -> None:
    with InProcessServer(host="0.0.0.0", **options) as server:
        log = server.log()
    assert "WARNING" in log and "insecure listener" in log  # with a token only: about clear text
    assert ("NEITHER TLS NOR a token" in log) is warned
