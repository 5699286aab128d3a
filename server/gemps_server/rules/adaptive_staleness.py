"""Staleness-adaptive SGD (DynSGD / lambda-softsync style): theta <- theta + Delta / (tau + 1)."""

from __future__ import annotations

import numpy as np

from gemps_server.rules.base import ApplyStats, CommitRule


class AdaptiveStalenessRule(CommitRule):
    name = "adaptive-staleness"

    def apply_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, worker_id: str, staleness: int
    ) -> ApplyStats:
        delta = np.multiply(update, np.float32(scale), out=self.scratch(update))
        delta /= np.float32(staleness + 1)  # after scaling, as the rule is written: same rounding
        theta += delta
        return ApplyStats.constant(1.0 / (staleness + 1))
