"""Reports of replicas that are not running, for tests that start one replica of a fresh job alone.

A fresh job elects its first primary only once every replica reported (DESIGN §3d: without an
in-sync list etcd cannot say who holds the acknowledged commits). A test that wants replica 0
serving alone reports the others as fresh replicas that hold nothing: what they would say if they
had started and never seen an epoch.
"""

from __future__ import annotations

import functools

from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease

from gemps_server.replication.election import partition_prefix
from gemps_server.replication.etcd_client import EtcdAccess, EtcdEndpoints
from gemps_server.replication.recovery import Report, replica_names

#: seconds the reports last: long enough for the lone replica to win, then they expire
REPORT_SECONDS = 30


def report_fresh(
    endpoint: str, job: str, replicas: int, *, but: int = 0, partition: int = 0, access: EtcdAccess | None = None
) -> None:
    """Report every replica of the partition but `but` as fresh (nothing held, no epoch seen);
    `access`: the etcd's credentials, when it asks for some."""
    etcd = EtcdEndpoints(endpoint, 5.0, access)
    members = partition_prefix(job, partition) + "/members/"

    def put(client: Etcd3Client, key: str, value: str) -> None:
        client.put(key, value, lease=Lease(client.lease(REPORT_SECONDS).id, client))

    try:
        for index, name in enumerate(replica_names(partition, replicas)):
            if index != but:
                report = Report(name, "not-started", 0, (0, 0)).to_json()
                etcd.call("report", functools.partial(put, key=members + name, value=report))
    finally:
        etcd.close()
