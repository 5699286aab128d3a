"""Look-ahead for asynchronous local steps: a window starts where θ is headed, not where it was.

A worker's update lands on a θ that the other workers' commits have moved since its reply: with
W equal workers, W - 1 commits later. Adam turns the gradient of that stale θ into a full-sized
step, so asynchronous AdamW workers fall far behind one worker at equal samples
(docs/RESULTS.md, "Adam through asynchrony"). DANA (Hakimi et al. 2019, "Taming Momentum in a
Distributed Asynchronous Environment") computes the gradient at an estimate of the θ the update
will meet instead. Here the estimate needs nothing from the server but what every reply holds:

    start = θ_reply + share · s · (θ_reply - θ_previous reply) / (v_reply - v_previous reply)

θ's move per commit, measured between this worker's last two replies, times s, the staleness its
commits meet (the smaller of its last two, so that one long pause does not throw θ far ahead).
Pure arithmetic on tensors (no I/O): LocalSteps calls it after each reply.
"""

from __future__ import annotations

import math

import torch

from gemps.pytorch.vector_pool import VectorPool


class LookAhead:
    """Where the next window starts, given each reply (`share` 0: the reply itself)."""

    def __init__(self, share: float) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (math.isfinite(share) and share >= 0):
            raise ValueError(f"look_ahead must be a number >= 0 (1: θ's whole expected move), not {share!r}")
        self.share = float(share)
        self._replied: torch.Tensor | None = None
        self._version = -1
        self._staleness: int | None = None

    @property
    def kept(self) -> torch.Tensor | None:
        """The last reply passed to `start`, which the next one measures the pace from."""
        return self._replied

    def start(
        self, replied: torch.Tensor, version: int, staleness: int, vectors: VectorPool | None = None
    ) -> torch.Tensor:
        """The θ to start from after a reply of `version` to a commit that met `staleness`. With the
        caller's `vectors`, `replied` is this object's once passed: the next start is computed over
        it in place (no θ-sized temporary), or it goes back to `vectors` when dropped; without, it is
        only read."""
        if self.share == 0:
            return replied  # off: no copy of θ kept
        previous, previous_version, previous_staleness = self._replied, self._version, self._staleness
        # Kept without a copy: its caller only reads a window's start, and writes no reply it passed.
        self._replied, self._version, self._staleness = replied, version, staleness
        if previous is None or version <= previous_version:
            return self._dropped(previous, replied, vectors)  # no pace yet, or θ restored to an older version
        expected = staleness if previous_staleness is None else min(staleness, previous_staleness)
        if expected <= 0:
            return self._dropped(previous, replied, vectors)  # no one else commits: θ stays till the next
        # In place, one θ-sized temporary (none with `vectors`): at 100M parameters each is 400 MB of
        # fresh pages to fault in. The same operations in the same order either way: the same bits.
        room = previous if vectors is not None and previous is not replied else None
        ahead = torch.sub(replied, previous) if room is None else torch.sub(replied, previous, out=room)
        return ahead.div_(version - previous_version).mul_(self.share * expected).add_(replied)

    @staticmethod
    def _dropped(previous: torch.Tensor | None, replied: torch.Tensor, vectors: VectorPool | None) -> torch.Tensor:
        """The window starts at `replied`; the reply kept before it goes back to `vectors`, if any."""
        if previous is not None and previous is not replied and vectors is not None:
            vectors.give(previous)
        return replied
