"""DOWNPOUR (Dean et al. 2012): plain asynchronous SGD, theta <- theta + Delta."""

from __future__ import annotations

import numpy as np

from gemps_server.rules.base import ApplyStats, CommitRule


class DownpourRule(CommitRule):
    name = "downpour"

    def apply_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, worker_id: str, staleness: int
    ) -> ApplyStats:
        theta += self.scaled(update, scale)
        return ApplyStats.constant(1.0)
