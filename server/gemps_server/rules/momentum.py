"""One global velocity: v <- mu*v + Delta, theta <- theta + v.

With a single worker this is synchronous momentum SGD, the proxy GEM aims to match and the
paper's reference curve.
"""

from __future__ import annotations

import numpy as np

from gemps_server.rules.base import ApplyStats, CommitRule, RuleParams


class MomentumRule(CommitRule):
    name = "momentum"

    def __init__(self, params: RuleParams, num_parameters: int) -> None:
        super().__init__(params, num_parameters)
        self._velocity = np.zeros(num_parameters, dtype=np.float32)

    def apply(self, theta: np.ndarray, update: np.ndarray, worker_id: str, staleness: int) -> ApplyStats:
        self._velocity *= np.float32(self.params.momentum)
        self._velocity += update
        theta += self._velocity
        return ApplyStats.constant(1.0)
