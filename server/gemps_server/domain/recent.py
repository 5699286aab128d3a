"""The last minute's applied commits, in time buckets: the rate, loss, staleness and pi Status shows.

One `RecentCommits` window is kept for the server (every commit applied here) and one per
registered worker (workers.py). Each is BUCKETS rows of sums in one float64 array, a ring
(whatever the commit rate): a commit adds to the newest row, or starts a row for its bucket over
the oldest one. The applier adds (here, or the compiled commit core: csrc/core_books.c, the same
operations in the same order, on `rows` and `ring`); Status reads from the event loop without a lock: the rows are
copied in one step (under the GIL), and a row read while a commit adds to it is off by that one
commit, which a minute's figures do not notice.
"""

from __future__ import annotations

import math

import numpy as np

from gemps_proto.status import RECENT_SECONDS, RecentCommits
from gemps_server.domain.rules.base import ApplyStats

#: buckets per RECENT_SECONDS: the window covers between 11/12 of a minute and a minute of commits
BUCKETS = 12
BUCKET_SECONDS = RECENT_SECONDS / BUCKETS

# A row: [its bucket's index (time // BUCKET_SECONDS), commits, samples, loss commits, loss sum,
# staleness sum, then the sums of each commit's mean pi, fraction of pi at 0 and fraction at pi_max]
_SUMS = 9  # a row's length
# The ring's place: [the newest row, how many rows are in use]
_NEWEST, _USED = 0, 1


class RecentWindow:
    """Commits applied since `start` (a monotonic time), the last RECENT_SECONDS of them kept."""

    __slots__ = ("_at", "_cells", "_start", "ring", "rows")

    def __init__(self, start: float) -> None:
        self._start = start
        self.rows = np.zeros((BUCKETS, _SUMS), dtype=np.float64)
        self.ring = np.array([BUCKETS - 1, 0], dtype=np.int64)
        # The same memory as memoryviews: one element read or written costs a fraction of numpy's.
        self._cells = self.rows.data.cast("B").cast("d")
        self._at = self.ring.data.cast("B").cast("q")

    def add(self, now: float, staleness: int, loss: float | None, num_samples: int | None, stats: ApplyStats) -> None:
        """One commit applied at `now`, with what it reported and how the rule scaled it."""
        index = now // BUCKET_SECONDS
        cells, at = self._cells, self._at
        row = at[_NEWEST] * _SUMS
        if not at[_USED] or cells[row] != index:
            newest = (at[_NEWEST] + 1) % BUCKETS
            self.rows[newest] = 0.0
            row = newest * _SUMS
            cells[row] = index
            at[_NEWEST], at[_USED] = newest, min(at[_USED] + 1, BUCKETS)
        cells[row + 1] = cells[row + 1] + 1
        cells[row + 2] = cells[row + 2] + (num_samples or 0)
        if loss is not None and math.isfinite(loss):
            cells[row + 3] = cells[row + 3] + 1
            cells[row + 4] = cells[row + 4] + loss
        cells[row + 5] = cells[row + 5] + staleness
        cells[row + 6] = cells[row + 6] + stats.scaling_mean
        cells[row + 7] = cells[row + 7] + stats.fraction_at_zero
        cells[row + 8] = cells[row + 8] + stats.fraction_at_max

    def summary(self, now: float) -> RecentCommits:
        """The commits of the buckets within a minute of `now`, over the span they cover."""
        first = now // BUCKET_SECONDS - (BUCKETS - 1)  # the oldest bucket still counted
        rows, ring = self.rows.copy(), self.ring.copy()
        newest, used = int(ring[_NEWEST]), int(ring[_USED])
        ordered = [rows[(newest - used + 1 + k) % BUCKETS].tolist() for k in range(used)]  # oldest first
        kept = [bucket for bucket in ordered if bucket[0] >= first]
        seconds = max(0.0, now - max(self._start, first * BUCKET_SECONDS))
        commits = int(sum(bucket[1] for bucket in kept))
        loss_commits = int(sum(bucket[3] for bucket in kept))

        def mean(at: int) -> float:  # over the commits
            return sum(bucket[at] for bucket in kept) / commits if commits else 0.0

        return RecentCommits(
            seconds=seconds,
            commits=commits,
            samples=int(sum(bucket[2] for bucket in kept)),
            loss_commits=loss_commits,
            loss=sum(bucket[4] for bucket in kept) / loss_commits if loss_commits else 0.0,
            staleness=mean(5),
            scaling_mean=mean(6),
            scaling_at_zero=mean(7),
            scaling_at_max=mean(8),
        )
