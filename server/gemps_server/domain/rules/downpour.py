"""DOWNPOUR (Dean et al. 2012): plain asynchronous SGD, theta <- theta + Delta."""

from __future__ import annotations

import numpy as np

from gemps_server.domain.rules.base import ApplyStats, CommitRule, StepContext
from gemps_server.domain.rules.overflow import OverflowGuard


class DownpourRule(OverflowGuard, CommitRule):
    name = "downpour"

    def step_scaled(
        self,
        theta: np.ndarray,
        update: np.ndarray,
        scale: float,
        context: StepContext,
    ) -> tuple[np.ndarray, ApplyStats]:
        update_peak = context.payload_peak
        bound = self.in_place_bound(self.peak_of(theta), self.update_peak(update, scale, update_peak))
        if bound is not None:  # cannot overflow
            theta += self.scaled(update, scale)
            self.remember_peak(theta, bound)
            return theta, ApplyStats.constant(1.0)
        updated = self.take_spare(theta)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by checked()
            np.add(theta, self.scaled(update, scale), out=updated)
        return self.checked(theta, updated), ApplyStats.constant(1.0)
