"""When an in-sync backup holds its partition back: the rule that drops a backup that is slow
though no entry of it ever waits --replica-timeout (DESIGN §3d).

The timeout alone misses a backup that acknowledges just inside it: every commit then waits
almost the timeout, and the partition runs at a few commits a second. Comparing the rates of
appends and acknowledgements misses it too: workers wait for their replies, so the primary
appends only as fast as its slowest in-sync backup acknowledges, and the two rates are equal
however slow that is. What shows it is how far behind the acknowledgements run, in seconds: the
age of the oldest entry the backup has not acknowledged (its lag in positions over the rate they
are appended). The monitor samples it; over a window of WINDOW x --replica-timeout, a backup is
dropped when commits waited on it for more than HELD of the window and it ran on average more
than BEHIND x --replica-timeout behind while they did (with the tests' 2 s: 0.5 s behind over 2
of 4 s). An honest backup applies what the primary applied, with the same code: it is a network
round trip and an entry's work behind (milliseconds; tens on a loaded 2-core machine), a hundred
times inside the rule; a slow link that needs more needs a longer --replica-timeout anyway, and
the rule scales with it. So does a large entry's work: the limit and the window grow by the time
the largest entry takes at links.ENTRY_BYTES_PER_SECOND (4 s at 100M float32 parameters; a backup
taking 1.5 s over a 200 MB entry ran 0.7 s behind on average, and was dropped as slow without
it). Commits waiting rarely (a slow backup of a quiet job) cost little and are left alone: the
partition is not held below the rate its workers ask for.
"""

from __future__ import annotations

import collections

#: the window the rule looks at, in --replica-timeout
WINDOW = 2.0
#: the share of the window commits must have waited on the backup
HELD = 0.5
#: how far behind the backup may run on average while commits wait on it, in --replica-timeout
BEHIND = 0.25


class LagWindow:
    """An in-sync backup's lag over the last WINDOW x `timeout` seconds, from the monitor's samples."""

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self.window = WINDOW * timeout
        self.limit = BEHIND * timeout
        self._since = now  # in sync since: the rule waits for a whole window
        self._last = now
        # (when, seconds held since the sample before, those seconds x the age, appended, acknowledged)
        self._samples: collections.deque[tuple[float, float, float, int, int]] = collections.deque()
        self._held = 0.0
        self._behind = 0.0  # the age integrated over the held seconds

    def add(self, now: float, age: float, appended: int, acked: int, entry_seconds: float = 0.0) -> str:
        """Record that the oldest entry the backup has not acknowledged is `age` seconds old (0:
        none) with `appended` the journal's last position and `acked` the backup's, its largest entry
        taking it `entry_seconds`; why it is to be dropped, with the figures, or "" while it is not."""
        self.window = WINDOW * (self.timeout + entry_seconds)
        self.limit = BEHIND * self.timeout + entry_seconds
        span, self._last = (now - self._last if age > 0 else 0.0), now
        self._samples.append((now, span, age * span, appended, acked))
        self._held += span
        self._behind += age * span
        while self._samples and self._samples[0][0] < now - self.window:
            _, span, behind, _, _ = self._samples.popleft()
            self._held -= span
            self._behind -= behind
        if now - self._since < self.window or self._held < HELD * self.window:
            return ""
        behind = self._behind / self._held
        if behind <= self.limit:
            return ""
        first, seconds = self._samples[0], max(now - self._samples[0][0], 1e-9)
        return (
            f"slow: commits waited on it {self._held:.1f} s of the last {self.window:g} s, with its acknowledgements "
            f"{behind:.2f} s behind the primary's appends on average (at most {self.limit:g} s: {BEHIND:g} x "
            f"--replica-timeout{' and its largest entry' if entry_seconds else ''}); it acknowledged "
            f"{(acked - first[4]) / seconds:.1f} entries/s, the primary appended "
            f"{(appended - first[3]) / seconds:.1f}/s"
        )
