"""Staleness-adaptive SGD (DynSGD / lambda-softsync style): theta <- theta + Delta / (tau + 1)."""

from __future__ import annotations

import numpy as np

from gemps_server.domain.rules.base import ApplyStats, CommitRule, StepContext
from gemps_server.domain.rules.overflow import OverflowGuard


class AdaptiveStalenessRule(OverflowGuard, CommitRule):
    name = "adaptive-staleness"

    def step_scaled(
        self,
        theta: np.ndarray,
        update: np.ndarray,
        scale: float,
        context: StepContext,
    ) -> tuple[np.ndarray, ApplyStats]:
        staleness, update_peak = context.staleness, context.payload_peak
        bound = self.in_place_bound(self.peak_of(theta), self.update_peak(update, scale, update_peak))
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by checked()
            delta = np.multiply(update, np.float32(scale), out=self.scratch(update))
            delta /= np.float32(staleness + 1)  # after scaling, as the rule is written: same rounding
            if bound is not None:  # cannot overflow
                theta += delta
                self.remember_peak(theta, bound)
                return theta, ApplyStats.constant(1.0 / (staleness + 1))
            updated = np.add(theta, delta, out=self.take_spare(theta))
        return self.checked(theta, updated), ApplyStats.constant(1.0 / (staleness + 1))
