"""One global velocity: v <- mu*v + Delta, theta <- theta + v.

With a single worker this is synchronous momentum SGD, the proxy GEM aims to match and the
paper's reference curve. Under a learning-rate schedule each gradient enters the velocity as
Delta = -eta(v)*g with the eta of the version it is applied at, so the velocity keeps the eta of
past commits (Sutskever et al.'s form; torch.optim.SGD instead scales its whole buffer by the
current eta: the two agree while eta is constant).
"""

from __future__ import annotations

import numpy as np

from gemps_server.rules.base import ApplyStats, CommitRule, Schedule, constant_schedule


class MomentumRule(CommitRule):
    name = "momentum"

    def __init__(
        self, num_parameters: int, *, learning_rate: float, momentum: float, schedule: Schedule = constant_schedule
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        self.momentum = momentum
        self._velocity = np.zeros(num_parameters, dtype=np.float32)

    def global_state(self) -> dict[str, np.ndarray]:
        return {"velocity": self._velocity.copy()}

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        velocity = state.get("velocity")
        if velocity is None or set(state) != {"velocity"} or velocity.shape != self._velocity.shape:
            raise ValueError(f"momentum rule state must be one 'velocity' of shape {list(self._velocity.shape)}")
        np.copyto(self._velocity, velocity)

    def apply_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, worker_id: str, staleness: int
    ) -> ApplyStats:
        self._velocity *= np.float32(self.momentum)
        self._velocity += self.scaled(update, scale)
        theta += self._velocity
        return ApplyStats.constant(1.0)
