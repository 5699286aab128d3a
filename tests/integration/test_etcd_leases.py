"""A primary's lease as short as --replica-lease asks, or a replica that refuses to start.

etcd raises a lease's TTL to its own shortest, 1.5 election timeouts in whole seconds: 2 s at its
defaults. `--replica-lease 1` was accepted and lasted 2 s, so a lost primary was replaced after
twice the time the option says, and nothing said so. The private etcd now runs a shorter election
timeout (one member has no peer to elect against), and an etcd that grants no lease that short is
named at start. Real etcd, real server processes.
"""

from __future__ import annotations

import base64
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from gemps_server.replication import local_etcd
from gemps_server.replication.election import Election, Member, new_incarnation
from gemps_server.replication.etcd_client import EtcdAccess, EtcdLeaseRefused, check_access, lease_ttl
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from tests.etcd_server import etcd_server
from tests.helpers import replication_secret_file


def gateway(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request to etcd's JSON gateway, its answer."""
    reply = requests.post(f"{url}/v3/{path}", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


@pytest.fixture
def etcd_at_its_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalEtcd]:
    """An etcd with etcd's own raft timing (heartbeat 100 ms, election timeout 1000 ms), as an
    external etcd started without those flags has."""
    monkeypatch.setattr(local_etcd, "HEARTBEAT_MS", 100)
    monkeypatch.setattr(local_etcd, "ELECTION_TIMEOUT_MS", 1000)
    with etcd_server() as etcd:
        yield etcd


def test_the_private_etcd_grants_the_one_second_lease_it_is_asked() -> None:
    """`gemps server --replicas R`'s own etcd (and the tests'): a lease of 1 s lasts 1 s, and a
    primary elected under `--replica-lease 1` holds a lease of 1 s."""
    with etcd_server() as etcd:
        assert gateway(etcd.endpoint, "lease/grant", {"TTL": 1})["TTL"] == "1"
        prefix = f"/gemps/leases-{uuid.uuid4().hex[:8]}/partition/0"
        me = Member("replica-0", new_incarnation(), "127.0.0.1:5000", "127.0.0.1:6000")
        election = Election(etcd.endpoint, prefix, me, lease_seconds=1.0)
        try:
            assert election.campaign() is not None
            key = base64.b64encode(election.primary_key.encode()).decode()
            lease = gateway(etcd.endpoint, "kv/range", {"key": key})["kvs"][0]["lease"]
            assert gateway(etcd.endpoint, "kv/lease/timetolive", {"ID": lease})["grantedTTL"] == "1"
        finally:
            election.close()


def test_an_etcd_granting_no_lease_that_short_is_refused_at_start(etcd_at_its_defaults: LocalEtcd) -> None:
    """An etcd whose shortest lease is 2 s: a replica given `--replica-lease 1` does not start, in a
    line naming the option, etcd's shortest lease and the etcd flag that shortens it; 1.5 (2 s for
    etcd, which counts whole seconds) passes the check."""
    url = etcd_at_its_defaults.endpoint
    assert gateway(url, "lease/grant", {"TTL": 1})["TTL"] == "2"  # what etcd does at its defaults
    expected = "grants no lease shorter than 2 s, and --replica-lease asks 1 s"
    with pytest.raises(EtcdLeaseRefused, match=re.escape(expected)) as refused:
        check_access(url, EtcdAccess(), "/gemps/probe/primary", 2.0, lease=1)
    assert "--election-timeout of at most 666 ms" in str(refused.value)
    assert lease_ttl(1.5) == 2  # etcd counts whole seconds: 1.5 is asked as 2, which this etcd grants
    check_access(url, EtcdAccess(), "/gemps/probe/primary", 2.0, lease=lease_ttl(1.5))  # no refusal
    server = ServerProcess(
        rule="downpour",
        replicas=2,
        replica_index=0,
        etcd=url,
        job="short-lease",
        replication_port=0,
        replica_lease=1.0,
        startup_timeout=60,
        replication_secret_file=replication_secret_file(),
    )
    try:
        with pytest.raises(RuntimeError, match=re.escape(expected)):
            server.start()
    finally:
        server.close()


def test_a_longer_lease_granted_after_the_start_is_warned_of_once(
    etcd_at_its_defaults: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """An etcd that grants a longer lease than asked, met after the start-up check (etcd replaced
    or reconfigured since): the election goes on with what etcd granted, and says so once."""
    prefix = f"/gemps/leases-{uuid.uuid4().hex[:8]}/partition/0"
    me = Member("replica-0", new_incarnation(), "127.0.0.1:5000", "127.0.0.1:6000")
    election = Election(etcd_at_its_defaults.endpoint, prefix, me, lease_seconds=1.0)
    try:
        with caplog.at_level(logging.WARNING, logger="gemps.server"):
            election.announce()  # a lease for its presence,
            assert election.campaign() is not None  # and one for its term: two grants
        told = [record.getMessage() for record in caplog.records if "grants no lease shorter" in record.getMessage()]
        assert len(told) == 1, told
        assert "--replica-lease asks 1 s" in told[0]
    finally:
        election.close()
