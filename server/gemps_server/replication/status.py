"""What a replica reports of its replication: metrics, Status and `gemps status` read this record.

The record crosses the wire in Status, so it is the protocol's (gemps_proto.status), defined once
there; the replication code names it from here.
"""

from __future__ import annotations

from gemps_proto.status import BACKUP, CANDIDATE, PRIMARY, ROLES, BackupLag, ReplicationStatus

__all__ = ["BACKUP", "CANDIDATE", "PRIMARY", "ROLES", "BackupLag", "ReplicationStatus"]
