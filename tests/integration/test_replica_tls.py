"""Replicas with TLS (issue 41, item 3): `--replicas` with `--tls-cert/--tls-key/--tls-client-ca`
runs the replication stream inside mutual TLS (each replica presents its --tls-cert, both ways,
signed by --tls-client-ca); a commit is acknowledged by both; a peer speaking plain TCP, or one
with a certificate of another CA, is refused. Certificates made here (tests/integration/test_security.py)."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

import gemps
from gemps_server.replication import frames
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.status import BACKUP
from tests.helpers import wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_replica_trust import PARAMETERS, answers, old_hello, relayed_pair
from tests.integration.test_replicas import replica_options, status_of, wait_replicated
from tests.integration.test_security import Pki, pki
from tests.replica_reports import report_fresh

__all__ = ["pki"]  # the fixture


def tls_options(pki: Pki) -> dict[str, Any]:
    return {"tls_cert": str(pki.server.cert), "tls_key": str(pki.server.key), "tls_client_ca": str(pki.ca.cert)}


def worker_tls(pki: Pki) -> dict[str, Any]:
    return {"ca_cert": str(pki.ca.cert), "client_cert": str(pki.client.cert), "client_key": str(pki.client.key)}


def test_replicas_with_tls_replicate_every_commit_inside_tls(
    start_server: StartServer, etcd: LocalEtcd, pki: Pki
) -> None:
    """Before: `--replicas` with TLS was refused at start."""
    with relayed_pair(start_server, etcd, "tls", **tls_options(pki)) as (relay, (primary, backup)):
        theta = np.full(PARAMETERS, 7.25, np.float32)
        with gemps.Client(primary.target, name="w", **worker_tls(pki)) as worker:
            worker.register({"w": np.zeros(PARAMETERS, np.float32)})
            for _ in range(4):
                assert worker.commit(theta, kind="update").version > 0  # acknowledged: both applied it
        wait_replicated([primary, backup])
        assert primary.server.state.core.version == backup.server.state.core.version == 4
        assert status_of(backup).applied >= 4
        sent, received = bytes(relay.sent), bytes(relay.received)
    # Past the admission and the door's answer (in clear: a MAC, a nonce, an index, the epoch), a
    # TLS handshake record, not a frame.
    assert sent.startswith(frames.PREAMBLE_MAGIC) and received.startswith(frames.DOOR_OPEN)
    assert sent[frames.PREAMBLE.size :].startswith(b"\x16\x03")
    assert received[len(frames.DOOR_OPEN) :].startswith(b"\x16\x03")
    stream = sent + received
    for clear in (b'"kind":', b"partition-0-replica", np.full(PARAMETERS, 29.0, np.float32).tobytes()[:16]):
        assert clear not in stream


def test_a_plain_tcp_peer_or_another_cas_certificate_is_refused(
    start_server: StartServer, etcd: LocalEtcd, pki: Pki
) -> None:
    options = tls_options(pki)
    report_fresh(etcd.endpoint, "tls-refuse", replicas=2)  # a fresh job elects once every replica reported
    primary = start_server(rule="downpour", **replica_options(etcd, 0, "tls-refuse", **options))
    wait_replicated([primary])
    port = primary.server.replication_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        frames.send(sock, old_hello(status_of(primary).epoch, ""))
        assert answers(sock) == [frames.REFUSED]  # at the door: no admission (no TLS before it)
    # A replica whose certificate another CA signed (it holds the replication secret) is no backup.
    rogue = dict(options, tls_cert=str(pki.rogue_client.cert), tls_key=str(pki.rogue_client.key))
    stranger = start_server(rule="downpour", **replica_options(etcd, 1, "tls-refuse", **rogue))
    wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in primary.log(), 20, "the stranger's certificate refused")
    assert status_of(stranger).role == BACKUP and status_of(primary).backups == ()
