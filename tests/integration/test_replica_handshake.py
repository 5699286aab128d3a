"""The replicas' handshake (replication/handshake.py) against a real primary: only the job's
credential proves a backup, under one of its partition's names other than the primary's; the
supervisor's generated secret is its user's alone."""

from __future__ import annotations

import dataclasses
import re
import secrets
import stat
import uuid
from pathlib import Path

import numpy as np
import pytest

import gemps
from gemps_proto.proofs import NONCE_BYTES, ReplicaSession
from gemps_server.replication import frames
from gemps_server.replication.credentials import SECRET_FILE, with_generated_secret
from gemps_server.replication.handshake import Refused
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.status import PRIMARY
from tests.helpers import TEST_REPLICATION_SECRET, InProcessServer, server_config, wait_for
from tests.integration.conftest import StartServer, StartServerProcess
from tests.integration.test_replicas import replica_options, status_of, wait_replicated
from tests.replica_peers import joined, key_of, knocked
from tests.replica_reports import report_fresh


def join(primary: InProcessServer, secret: str, job: str, name: str) -> bytes:
    """Say hello to `primary` as `name`, proving `secret`: the ticket key it welcomed us with."""
    assert job == primary.server.config.job
    sock, tickets = joined(primary, name, secret=secret)
    sock.close()
    return tickets


def impostor(primary: InProcessServer, secret: str, job: str, name: str) -> frames.Frame:
    """Knock as the partition's backup holding the key of `secret` and `job`, say hello as `name`
    and prove the key without checking the primary's proof (as a peer that wants in would): the
    primary's last word (REFUSED, at its door or after the hello, or WELCOME)."""
    status = status_of(primary)
    address = f"127.0.0.1:{primary.server.replication_port}"
    nonce = secrets.token_bytes(NONCE_BYTES)
    hello = {"name": name, "incarnation": "i", "address": "127.0.0.1:1", "replication": "127.0.0.1:2"}
    try:
        knocking = knocked(primary, "partition-0-replica-1", secret, job)
    except Refused as refused:
        return frames.Frame(frames.REFUSED, {"reason": str(refused)})
    with knocking as sock:
        frames.send(sock, frames.Frame(frames.HELLO, dict(hello, epoch=status.epoch, nonce=nonce.hex())))
        challenge = frames.receive(sock)
        if challenge.kind != frames.CHALLENGE:
            return challenge
        session = ReplicaSession(
            key_of(secret, job), 0, status.epoch, address, nonce, bytes.fromhex(challenge.header["nonce"])
        )
        frames.send(sock, frames.Frame(frames.PROOF, {"proof": session.proof("backup", name).hex()}))
        return frames.receive(sock)


@pytest.fixture
def primary(start_server: StartServer, etcd: LocalEtcd) -> InProcessServer:
    """A lone primary of job `names-<a fresh suffix>` (a job of its own: no earlier in-sync set)."""
    job = f"names-{uuid.uuid4().hex[:8]}"
    report_fresh(etcd.endpoint, job, replicas=2)  # a fresh job elects once every replica reported
    server = start_server(rule="downpour", **replica_options(etcd, 0, job))
    wait_replicated([server])
    return server


def job_of(server: InProcessServer) -> str:
    return server.server.config.job


def test_the_credential_proves_a_backup_and_the_ticket_key_arrives_sealed(primary: InProcessServer) -> None:
    tickets = join(primary, TEST_REPLICATION_SECRET, job_of(primary), "partition-0-replica-1")
    assert tickets == primary.server.replication.replica._tickets.key  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("secret", "job", "name", "why"),  # job "": the primary's
    [
        ("another-secret-0123456789", "", "partition-0-replica-1", "no proof of the replication credential"),
        (TEST_REPLICATION_SECRET, "another-job", "partition-0-replica-1", "no proof of the replication credential"),
        (TEST_REPLICATION_SECRET, "", "partition-0-replica-0", "the primary's own name"),
        (TEST_REPLICATION_SECRET, "", "partition-0-replica-2", "is not a replica of partition 0 (of 2)"),
        (TEST_REPLICATION_SECRET, "", "partition-1-replica-1", "is not a replica of partition 0 (of 2)"),
        # Issue 61 item 11: names that read as a replica's number but are not its name were welcomed.
        (TEST_REPLICATION_SECRET, "", "partition-00-replica-1", "is not a replica of partition 0 (of 2)"),
        (TEST_REPLICATION_SECRET, "", "partition-0-replica-01", "is not a replica of partition 0 (of 2)"),
        (TEST_REPLICATION_SECRET, "", "partition-0-replica-00", "is not a replica of partition 0 (of 2)"),
    ],
    ids=[
        "wrong-secret",
        "another-jobs-key",
        "the-primarys-name",
        "no-such-replica",
        "another-partition",
        "alias-partition",
        "alias-replica",
        "alias-of-the-primary",
    ],
)
def test_a_peer_is_refused_without_the_key_or_under_a_name_not_its_own(
    primary: InProcessServer, secret: str, job: str, name: str, why: str
) -> None:
    answer = impostor(primary, secret, job or job_of(primary), name)
    assert answer.kind == frames.REFUSED and why in answer.header["reason"]
    assert status_of(primary).backups == ()


def test_a_backup_holding_another_key_is_refused_at_the_door(primary: InProcessServer) -> None:
    """(A primary proving another key to a backup: test_replica_trust.py's fake primary.)"""
    with pytest.raises(Refused, match="no proof of the replication credential"):
        join(primary, "another-secret-0123456789", job_of(primary), "partition-0-replica-1")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("partition-0-replica-0", "partition-0-replica-0 is the primary's own name"),
        ("partition-0-replica-2", "'partition-0-replica-2' is not a replica of partition 0 (of 2)"),
    ],
    ids=["the-primarys-index", "no-such-index"],
)
def test_an_admission_under_an_index_that_is_no_backup_is_refused_at_the_door(
    primary: InProcessServer, name: str, why: str
) -> None:
    """An admission names its replica by index (no name crosses before TLS): the primary's own, or
    past the partition's replicas (proved with the key, as a peer of 3 replicas), is refused."""
    with pytest.raises(Refused, match=re.escape(why)):
        knocked(primary, name, replicas=3).close()
    assert status_of(primary).backups == ()


def test_a_session_seals_for_its_two_ends_only() -> None:
    session = ReplicaSession(b"k" * 32, 0, 3, "h:1", b"b" * 32, b"p" * 32)
    sealed = session.seal(b"t" * 32)
    assert session.unseal(sealed) == b"t" * 32 and bytes.fromhex(sealed) != b"t" * 32
    other = dataclasses.replace(session, primary_nonce=b"q" * 32)
    assert other.unseal(sealed) != b"t" * 32
    assert session.proof("primary", "n") != session.proof("backup", "n")


def test_the_supervisor_generates_a_secret_only_its_user_reads(tmp_path: Path) -> None:
    config = with_generated_secret(server_config(replicas=2), tmp_path)
    path = Path(config.replication_secret_file)
    assert path == tmp_path / SECRET_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(bytes.fromhex(path.read_text().strip())) == 32
    # A given secret is kept; a replica started alone brings its own (a generated one is no one else's).
    given = server_config(replicas=2, replication_secret_file=str(path))
    assert with_generated_secret(given, tmp_path) is given
    alone = server_config(replicas=2, replica_index=0, etcd="http://e:2379", auth_token="t0ken")
    assert with_generated_secret(alone, tmp_path) is alone


def test_replicas_started_on_one_machine_share_a_generated_secret(
    start_server_process: StartServerProcess, tmp_path: Path
) -> None:
    """`gemps server --replicas 2`: no secret given, none needed; the supervisor draws one."""
    log = tmp_path / "supervisor.log"
    supervisor = start_server_process(replicas=2, replication_port=0, rule="downpour", log_path=log, log_level="info")
    wait_for(lambda: "workers: --server" in log.read_text(), 60, "the supervisor's layout line")
    target = re.findall(r"workers: --server '([^']+)'", log.read_text())[0]

    def replicated() -> bool:
        views = []
        for replica in target.split("|"):
            with gemps.Client(replica, timeout=5) as client:
                views.append(client.status().replication)
        primaries = [view for view in views if view is not None and view.role == PRIMARY]
        return len(primaries) == 1 and [b.in_sync for b in primaries[0].backups] == [True]

    wait_for(replicated, 60, "one primary, its backup in sync")
    with gemps.Client(target, name="w") as worker:
        worker.register({"w": np.zeros(8, np.float32)})
        assert worker.commit(np.ones(8, np.float32), kind="update").version == 1
    # Both replicas read one secret file, the supervisor's, readable by its user alone.
    children = Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children").read_text().split()
    files = set()
    for child in children:
        environ = dict(
            entry.split("=", 1) for entry in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in entry
        )
        if "GEMPS_REPLICA_INDEX" in environ:
            files.add(environ["GEMPS_REPLICATION_SECRET_FILE"])
    (secret,) = files
    assert stat.S_IMODE(Path(secret).stat().st_mode) == 0o600
