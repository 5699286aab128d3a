"""The in-sync set's floor (--min-in-sync, DESIGN §3d): how few replicas may hold what a primary
acknowledges.

The set never shrinks below `min_in_sync` replicas (the primary one of them), and nothing is
acknowledged while fewer hold it: a primary whose backups are all out of reach stops
acknowledging rather than hold alone what it would lose on dying while they live. A backup the
floor keeps listed stays in the set, so it can still be promoted, and commits wait for it; one that
went quiet or fell an image behind is let go (memory stays bounded) and its next hello takes its
place, seeded anew. Once another backup is in sync it leaves the set as any other. The forwarder
applies the rule; this says it once.
"""

from __future__ import annotations

import logging

from gemps_server.logs import Throttle, event

log = logging.getLogger("gemps.server")

#: seconds between two ERROR lines about one backup the floor keeps in the set
KEPT_LOG_SECONDS = 5.0


class InSyncFloor:
    """At least `min_in_sync` replicas in the set, of a primary with at most `backups` backups."""

    def __init__(self, min_in_sync: int, backups: int) -> None:
        self.backups = max(0, min(min_in_sync - 1, backups))  # the floor, the primary aside
        self._kept = Throttle(KEPT_LOG_SECONDS)

    def above(self, backups: int) -> bool:
        """Whether `backups` in the set are fewer than the floor asks (none may leave; no ack)."""
        return backups < self.backups

    def missing(self, backups: int) -> int:
        """How many more than `backups` the set must keep."""
        return max(0, self.backups - backups)

    def log_kept(self, backup: str, why: str, epoch: int) -> None:
        """An ERROR line (one every few seconds a backup): `backup` would leave the set for `why`."""
        if (suppressed := self._kept.allow(backup)) is not None:
            event(log, "backup kept in sync", level=logging.ERROR, backup=backup, reason=why, epoch=epoch,
                  min_in_sync=self.backups + 1, suppressed=suppressed or None,
                  consequence="no commit is acknowledged until it, or another backup, applies it")  # fmt: skip

    def describe(self, held: list[tuple[str, float | None]]) -> str:
        """What Status says of the backups the floor keeps, out of reach: (name, seconds behind, or
        None when disconnected); "" for none."""
        if not held:
            return ""
        names = ", ".join(f"{name} ({'disconnected' if behind is None else f'{behind:.1f} s behind'})"
                          for name, behind in held)  # fmt: skip
        return (f"no commit is acknowledged until {names} or another backup applies it: "
                f"--min-in-sync {self.backups + 1} keeps it in the in-sync set")  # fmt: skip
