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

    def global_state(self) -> dict[str, np.ndarray]:
        return {"velocity": self._velocity.copy()}

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        velocity = state.get("velocity")
        if velocity is None or set(state) != {"velocity"} or velocity.shape != self._velocity.shape:
            raise ValueError(f"momentum rule state must be one 'velocity' of shape {list(self._velocity.shape)}")
        np.copyto(self._velocity, velocity)

    def apply(
        self, theta: np.ndarray, update: np.ndarray, worker_id: str, staleness: int, scale: float = 1.0
    ) -> ApplyStats:
        self._velocity *= np.float32(self.params.momentum)
        self._velocity += self.scaled(update, scale)
        theta += self._velocity
        return ApplyStats.constant(1.0)
