"""What a replica reports of its replication: metrics, Status and `gemps status` read this record."""

from __future__ import annotations

from dataclasses import dataclass, field

#: a replica's role: serving workers and forwarding, applying what a primary forwards, or looking for one
PRIMARY, BACKUP, CANDIDATE = "primary", "backup", "candidate"


@dataclass(frozen=True)
class BackupLag:
    """One backup as its primary sees it."""

    name: str
    in_sync: bool  # in the acknowledging (in-sync) set: every commit waits for it
    lag_commits: int  # journal entries forwarded or queued that it has not acknowledged
    lag_seconds: float  # age of the oldest entry it has not acknowledged (0 when none)


@dataclass(frozen=True)
class ReplicationStatus:
    """A replica's role and epoch, and, on a primary, its backups."""

    name: str  # this replica's name (unique within its partition)
    role: str  # PRIMARY, BACKUP or CANDIDATE
    epoch: int  # the primary's epoch this replica follows or holds (0: none known)
    replicas: int  # R: how many replicas the partition is meant to have
    primary: str = ""  # the worker-facing address of the primary (on a backup; "" when none known)
    backups: tuple[BackupLag, ...] = field(default=())  # on a primary
    forwarded: int = 0  # journal entries forwarded to backups, over this process's life
    applied: int = 0  # journal entries applied from a primary (on a backup), over this process's life
    failovers: int = 0  # times this replica became primary

    @property
    def live(self) -> int:
        """Replicas acknowledging commits now: the primary and its in-sync backups (a backup: 0)."""
        return 1 + sum(backup.in_sync for backup in self.backups) if self.role == PRIMARY else 0

    @property
    def under_replicated(self) -> bool:
        return self.role == PRIMARY and self.live < self.replicas
