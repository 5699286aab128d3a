"""Replicated partitions (DESIGN §3d): a primary and backups per partition of θ.

The primary journals every state change in its applied order and forwards it to each backup,
which applies it through the same domain code; a commit is acknowledged once every backup in the
in-sync set applied it. Who is primary is decided by etcd (election.py): a lease-bound key per
partition, whose revision is the epoch. The server is composed with it through
`layer.layer()`: the one name app.py calls.

Public, for the command line and tools (the one door the import contracts leave open here; every
module below it is the server's own): `LocalEtcd` and `find_etcd` (an etcd on this machine: the
partitions' supervisor, `gemps ray`, the benchmarks), `with_generated_secret` (the secret a
supervisor generates for the replicas it runs) and `ReplicationCollector` (a replica's metric
families, which the reference docs list).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemps_server.replication.credentials import with_generated_secret
    from gemps_server.replication.local_etcd import LocalEtcd, find_etcd
    from gemps_server.replication.metrics import ReplicationCollector

# Imported when first used: every server imports this package (its layer.py), and these modules
# bring cryptography, requests and etcd3gw, which a server without replicas never uses (a fifth of
# its start-up).
_HOMES = {
    "with_generated_secret": "gemps_server.replication.credentials",
    "LocalEtcd": "gemps_server.replication.local_etcd",
    "find_etcd": "gemps_server.replication.local_etcd",
    "ReplicationCollector": "gemps_server.replication.metrics",
}
__all__ = ["LocalEtcd", "ReplicationCollector", "find_etcd", "with_generated_secret"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:  # a submodule not yet imported: `from gemps_server.replication import frames` imports it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
