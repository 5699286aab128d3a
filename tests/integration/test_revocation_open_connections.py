"""A certificate revoked while its holder is connected (issue 77, item 6): the data plane's
connections, TCP (TLS) and local (the Unix socket, which has no TLS: the worker's certificate is
the one it registered with), are checked on every request, not only at their handshake, so an
open connection is refused within a look at the list (RECHECK_SECONDS) of the revocation; and the
local socket refuses a worker registered with a certificate the list revokes."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from gemps_proto.reasons import Reason
from gemps_server.revocation import RECHECK_SECONDS
from tests.data_plane_client import DataPlaneClient, Frame
from tests.helpers import wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_certificate_revocation import P, mutual, register
from tests.integration.test_data_plane_hostile import refusals
from tests.integration.test_data_plane_tls import client_context
from tests.pki import Authority

#: how long a revocation may take to reach an open connection: a look at the file, and a margin
IN_FORCE_WITHIN = 10 * RECHECK_SECONDS


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def refused_as_revoked(frame: Frame) -> bool:
    error = frame.error
    return error is not None and error.reason == Reason.REVOKED_CERTIFICATE.value and "revoked" in error.message


def refused_now(client: DataPlaneClient, worker_id: str) -> bool:
    """Whether a pull on `client`'s open connection is refused as revoked (it went through: False)."""
    try:
        frame = client.pull(worker_id)
    except ConnectionError:
        return False  # closed without saying why: not the refusal looked for
    return refused_as_revoked(frame)


def test_an_open_tls_connection_is_refused_once_its_certificate_is_revoked(
    start_server: StartServer, ca: Authority, tmp_path: Path
) -> None:
    """Before: checked at the handshake only, so a connection opened before the revocation kept
    committing for as long as it stayed open (a busy worker's never idles out)."""
    worker, other = ca.issue("worker-open"), ca.issue("other")
    crl = ca.revoke(tmp_path / "crl.pem", other)
    server = start_server(rule="downpour", **mutual(ca, ca.issue("server", server=True), crl))
    reply = register(server, ca, worker)
    with DataPlaneClient(reply.data_plane.port, tls=client_context(ca.ca, worker)) as client:
        assert client.hello(reply.worker_id, reply.data_plane.ticket).error is None
        assert client.commit(reply.worker_id, np.ones(P, np.float32), 0).error is None
        ca.revoke(crl, other, worker)
        wait_for(lambda: refused_now(client, reply.worker_id), IN_FORCE_WITHIN, "the open connection refused")
        assert client.closed_by_server()
    assert refusals(server)["revoked_certificate"] == 1


def test_the_local_socket_refuses_a_worker_whose_registration_certificate_is_revoked(
    start_server: StartServer, ca: Authority, tmp_path: Path
) -> None:
    """The local socket has no TLS: before, a worker registered with a certificate revoked since
    went on committing there with its ticket, on a connection open before the revocation and on
    new ones."""
    worker, other = ca.issue("worker-local"), ca.issue("other")
    crl = ca.revoke(tmp_path / "crl.pem", other)
    server = start_server(rule="downpour", shared_memory="on", **mutual(ca, ca.issue("server", server=True), crl))
    reply = register(server, ca, worker)
    local = reply.data_plane.local_socket
    assert local
    with DataPlaneClient(0, local_socket=local) as client:
        assert client.hello(reply.worker_id, reply.data_plane.ticket).error is None
        assert client.commit(reply.worker_id, np.ones(P, np.float32), 0).error is None
        ca.revoke(crl, other, worker)
        wait_for(lambda: refused_now(client, reply.worker_id), IN_FORCE_WITHIN, "the open local connection refused")
    with DataPlaneClient(0, local_socket=local) as again:
        refused = again.hello(reply.worker_id, reply.data_plane.ticket)
        assert refused_as_revoked(refused), refused
        error = refused.error
        assert error is not None and error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert "CN=worker-local" in error.message
    assert refusals(server)["revoked_certificate"] == 2


def test_a_certificate_under_a_revoked_intermediate_is_refused_on_grpc_and_the_data_plane(
    start_server: StartServer, ca: Authority, tmp_path: Path
) -> None:
    """Workers' certificates signed by intermediate CAs, which they present with their own; the
    root's list revokes one intermediate. Before: only the worker's own certificate was looked
    up, so every certificate that intermediate signed was still accepted."""
    good, bad = ca.intermediate("intermediate-good"), ca.intermediate("intermediate-bad")
    honest, under_bad = good.issue("worker-good"), bad.issue("worker-under-bad")
    crl = ca.revoke(tmp_path / "crl.pem", bad.ca)
    server = start_server(rule="downpour", **mutual(ca, ca.issue("server", server=True), crl))
    reply = register(server, ca, honest)
    with pytest.raises(grpc.RpcError) as refused:
        register(server, ca, under_bad)
    error: Any = refused.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "CN=worker-under-bad" in error.details() and "issued under CN=intermediate-bad" in error.details()
    with DataPlaneClient(reply.data_plane.port, tls=client_context(ca.ca, honest)) as client:
        assert client.hello(reply.worker_id, reply.data_plane.ticket).error is None
    with (
        pytest.raises((ssl.SSLError, ConnectionError)),
        DataPlaneClient(reply.data_plane.port, tls=client_context(ca.ca, under_bad)) as bad_client,
    ):
        bad_client.hello(reply.worker_id, reply.data_plane.ticket)
    wait_for(lambda: refusals(server)["revoked_certificate"] == 1, timeout=10, what="the refusal counted")
