"""The last minute's applied commits, in time buckets: the rate, loss, staleness and pi Status shows.

One `RecentCommits` window is kept for the server (every commit applied here) and one per
registered worker (workers.py). Each is at most BUCKETS small lists, whatever the commit rate:
a commit adds to the newest bucket, and buckets older than a minute are dropped. The applier
adds; Status reads from the event loop without a lock: the deque is copied in one step (under
the GIL), and a bucket read while a commit adds to it is off by that one commit, which a
minute's figures do not notice.
"""

from __future__ import annotations

import math
from collections import deque

from gemps_proto.status import RECENT_SECONDS, RecentCommits
from gemps_server.domain.rules.base import ApplyStats

#: buckets per RECENT_SECONDS: the window covers between 11/12 of a minute and a minute of commits
BUCKETS = 12
BUCKET_SECONDS = RECENT_SECONDS / BUCKETS

# A bucket: [its index (time // BUCKET_SECONDS), commits, samples, loss commits, loss sum, staleness sum,
# then the sums of each commit's mean pi, fraction of pi at 0 and fraction at pi_max]
Bucket = list[float]
_SUMS = 9  # a bucket's length


class RecentWindow:
    """Commits applied since `start` (a monotonic time), the last RECENT_SECONDS of them kept."""

    __slots__ = ("_buckets", "_start")

    def __init__(self, start: float) -> None:
        self._start = start
        self._buckets: deque[Bucket] = deque(maxlen=BUCKETS)

    def add(self, now: float, staleness: int, loss: float | None, num_samples: int | None, stats: ApplyStats) -> None:
        """One commit applied at `now`, with what it reported and how the rule scaled it."""
        index = now // BUCKET_SECONDS
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append([index] + [0.0] * (_SUMS - 1))
        bucket = self._buckets[-1]
        bucket[1] += 1
        bucket[2] += num_samples or 0
        if loss is not None and math.isfinite(loss):
            bucket[3] += 1
            bucket[4] += loss
        bucket[5] += staleness
        bucket[6] += stats.scaling_mean
        bucket[7] += stats.fraction_at_zero
        bucket[8] += stats.fraction_at_max

    def summary(self, now: float) -> RecentCommits:
        """The commits of the buckets within a minute of `now`, over the span they cover."""
        first = now // BUCKET_SECONDS - (BUCKETS - 1)  # the oldest bucket still counted
        kept = [bucket for bucket in list(self._buckets) if bucket[0] >= first]
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
