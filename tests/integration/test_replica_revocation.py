"""Replicas whose certificate is revoked while the replication stream runs (issue 77, item 6): real
etcd, real replicas, each with a certificate of its own and --tls-crl. Before, both ends checked
the list at the handshake only: a backup revoked while attached went on receiving every entry (and
counted in the in-sync set), a backup went on following a revoked primary, and a revoked primary
went on leading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gemps
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.status import PRIMARY
from gemps_server.revocation import RECHECK_SECONDS
from tests.helpers import InProcessServer, wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_data_plane_hostile import refusals
from tests.integration.test_replica_shared_memory import shared_now
from tests.integration.test_replicas import LEASE, PARAMETERS, replica_options, status_of, wait_replicated
from tests.pki import Authority, Issued
from tests.replica_reports import report_fresh

#: a look at the list, a monitor's or a frame's check, the etcd write that drops it; with a margin
IN_FORCE_WITHIN = 10 * RECHECK_SECONDS + 10 * LEASE


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def tls(ca: Authority, own: Issued, crl: Path | None) -> dict[str, Any]:
    options: dict[str, Any] = {"tls_cert": str(own.cert), "tls_key": str(own.key), "tls_client_ca": str(ca.ca.cert)}
    return options | ({"tls_crl": str(crl)} if crl is not None else {})


def pair(
    start_server: StartServer, etcd: LocalEtcd, job: str, first: dict[str, Any], second: dict[str, Any]
) -> tuple[InProcessServer, InProcessServer]:
    """Replica 0 (`first`'s options) the primary, replica 1 its backup, in sync."""
    report_fresh(etcd.endpoint, job, replicas=2)  # a fresh job elects once every replica reported
    primary = start_server(rule="downpour", **replica_options(etcd, 0, job, **first))
    wait_replicated([primary])
    backup = start_server(rule="downpour", **replica_options(etcd, 1, job, **second))
    wait_replicated([primary, backup])
    return primary, backup


def revocable_pair(
    start_server: StartServer, etcd: LocalEtcd, ca: Authority, folder: Path, job: str, on_primary: bool = True
) -> tuple[dict[str, Issued], Path, tuple[InProcessServer, InProcessServer]]:
    """Certificates for two replicas and an unrelated peer, a list that revokes the unrelated one
    (given to the backup, and to the primary when `on_primary`), and the pair in sync."""
    own = {name: ca.issue(name, server=True) for name in ("replica-0", "replica-1", "unrelated")}
    crl = ca.revoke(folder / "crl.pem", own["unrelated"])
    first, second = tls(ca, own["replica-0"], crl if on_primary else None), tls(ca, own["replica-1"], crl)
    return own, crl, pair(start_server, etcd, job, first, second)


def test_a_backup_revoked_while_attached_is_let_go_and_refused_again(
    start_server: StartServer, etcd: LocalEtcd, ca: Authority, tmp_path: Path
) -> None:
    own, crl, (primary, backup) = revocable_pair(start_server, etcd, ca, tmp_path, "crl-backup")
    ca.revoke(crl, own["unrelated"], own["replica-1"])
    wait_for(lambda: status_of(primary).backups == (), IN_FORCE_WITHIN, "the revoked backup let go")
    assert "backup's certificate CN=replica-1" in primary.log()
    wait_for(lambda: primary.log().count("CN=replica-1") >= 2, IN_FORCE_WITHIN, "its next hello refused too")
    assert status_of(primary).role == PRIMARY and status_of(backup).role != PRIMARY  # it does not campaign


def test_a_primary_revoked_while_leading_steps_down_and_its_backup_leads(
    start_server: StartServer, etcd: LocalEtcd, ca: Authority, tmp_path: Path
) -> None:
    own, crl, (primary, backup) = revocable_pair(start_server, etcd, ca, tmp_path, "crl-primary")
    ca.revoke(crl, own["unrelated"], own["replica-0"])
    wait_for(lambda: status_of(backup).role == PRIMARY, IN_FORCE_WITHIN, "the backup leading")
    assert status_of(primary).role != PRIMARY
    assert "steps down as its partition's primary: its own certificate CN=replica-0" in primary.log()


def test_a_backup_lets_go_of_a_primary_its_list_revokes(
    start_server: StartServer, etcd: LocalEtcd, ca: Authority, tmp_path: Path
) -> None:
    """The list on the backup alone (the primary has none, so it does not step down): the backup
    ends the stream it follows, and does not follow that primary again."""
    own, crl, (primary, backup) = revocable_pair(start_server, etcd, ca, tmp_path, "crl-follower", on_primary=False)
    ca.revoke(crl, own["unrelated"], own["replica-0"])
    wait_for(lambda: status_of(primary).backups == (), IN_FORCE_WITHIN, "the backup gone from the primary")
    wait_for(
        lambda: backup.log().count("primary's certificate CN=replica-0") >= 2,
        IN_FORCE_WITHIN,
        "the stream ended, and the next handshake refused",
    )


def test_after_a_failover_a_worker_goes_on_over_tls_where_the_local_socket_does_not_know_it(
    start_server: StartServer, etcd: LocalEtcd, ca: Authority, tmp_path: Path
) -> None:
    """With --tls-crl the local socket answers for the certificate a worker registered with; the
    new primary after a failover did not register it, so its local socket refuses it and the
    worker goes on, without registering again, over the TCP port, whose TLS shows its
    certificate (worker_certificates.py)."""
    _, _, (primary, backup) = revocable_pair(start_server, etcd, ca, tmp_path, "crl-failover")
    worker = ca.issue("worker")
    ones = np.ones(PARAMETERS, np.float32)
    with gemps.Client(
        f"{primary.target}|{backup.target}", name="w", timeout=60,
        ca_cert=str(ca.ca.cert), client_cert=str(worker.cert), client_key=str(worker.key),
    ) as client:  # fmt: skip
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        client.commit(ones, kind="update")
        assert shared_now(client)  # registered here: its local socket knows the certificate
        primary.stop()
        wait_for(lambda: status_of(backup).role == PRIMARY, IN_FORCE_WITHIN, "the backup leading")
        for _ in range(3):
            client.commit(ones, kind="update")
        assert not shared_now(client)
    assert backup.server.state.core.version == 4
    refused = sum(count for reason, count in refusals(backup).items() if reason.startswith("unauthenticated"))
    assert refused >= 1 and "did not register at this server" in backup.log()
