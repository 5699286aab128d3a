"""A replica as the election names it (`Member`), and the names etcd keys are made of."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass


def partition_prefix(job: str, partition: int) -> str:
    """The etcd prefix of one partition's election keys."""
    return f"/gemps/{job}/partition/{partition}"


def new_incarnation() -> str:
    """A random id for this process: a restarted replica is a new incarnation, never in-sync."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Member:
    """One replica process, as the primary key and the in-sync list name it."""

    name: str  # unique within the partition, e.g. "partition-0-replica-1"
    incarnation: str  # this process's random id (new_incarnation())
    address: str  # worker-facing gRPC host:port
    replication: str  # host:port of its replication listener (backups dial the primary here)

    @property
    def identity(self) -> tuple[str, str]:
        """(name, incarnation): what the in-sync list holds."""
        return (self.name, self.incarnation)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        fields = json.loads(text)
        return cls(
            name=str(fields["name"]),
            incarnation=str(fields["incarnation"]),
            address=str(fields["address"]),
            replication=str(fields["replication"]),
        )
