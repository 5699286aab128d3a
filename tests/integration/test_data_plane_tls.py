"""The data plane under TLS and mutual TLS: the gRPC port's certificates, the same trust."""

from __future__ import annotations

import ssl

import numpy as np
import pytest

from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.data_plane_client import DataPlaneClient
from tests.helpers import wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_data_plane_hostile import refusals
from tests.integration.test_security import Pki, pki, tls_channel
from tests.pki import Issued

__all__ = ["pki"]  # the fixture, used here by name
P = 100


def client_context(ca: Issued | None, client: Issued | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert) if ca else None)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def test_mutual_tls_on_the_data_plane(start_server: StartServer, pki: Pki) -> None:
    server = start_server(
        rule="downpour",
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        tls_client_ca=pki.ca.cert,
        handshake_timeout=1.0,
        data_plane_hello_timeout=1.0,
    )
    stub = pb_grpc.ParameterServerStub(tls_channel(server.target, pki.ca.cert, pki.client))
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    reply = stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(P, np.float32))))
    port = reply.data_plane.port
    with DataPlaneClient(port, tls=client_context(pki.ca, pki.client)) as client:
        assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
        assert client.commit(reply.worker_id, np.ones(P, np.float32), 0).op == Op.COMMIT | REPLY
    # No client certificate, one from a CA the server does not trust, or plaintext: refused.
    for context in (client_context(pki.ca, None), client_context(pki.ca, pki.rogue_client)):
        # (TLS 1.3: the refusal may come on the first read)
        with pytest.raises((ssl.SSLError, ConnectionError)), DataPlaneClient(port, tls=context) as client:
            client.hello(reply.worker_id, reply.data_plane.ticket)
    with DataPlaneClient(port) as plain:
        plain.sock.sendall(b"GMDP" + bytes(16))
        assert plain.closed_by_server()
    wait_for(lambda: refusals(server)["tls"] == 3, timeout=10, what="three TLS refusals counted")
    assert server.server.state.core.version == 1
