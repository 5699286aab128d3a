"""One global velocity: v <- mu*v + Delta, theta <- theta + v (`momentum`), or theta <- theta +
mu*v + Delta, Nesterov's look-ahead (`nesterov`: DiLoCo's outer optimizer, run asynchronously on
each worker's accumulated update, the baseline GEM with local steps is compared with, issue 47).

With a single worker this is synchronous momentum SGD, the proxy GEM aims to match and the
paper's reference curve. Under a learning-rate schedule each gradient enters the velocity as
Delta = -eta(v)*g with the eta of the version it is applied at, so the velocity keeps the eta of
past commits (Sutskever et al.'s form; torch.optim.SGD instead scales its whole buffer by the
current eta: the two agree while eta is constant).
"""

from __future__ import annotations

import numpy as np

from gemps_proto.ranges import Range
from gemps_proto.rule_options import RuleOption
from gemps_server.domain.rules.base import ApplyStats, CommitRule, Schedule, StepContext, constant_schedule
from gemps_server.domain.rules.overflow import OverflowGuard
from gemps_server.native import max_abs

#: mu, the velocity's decay: the momentum rules', and GEM's proxy's (one option, one flag)
MOMENTUM = RuleOption("momentum", 0.9, Range(0, 1, high_open=True), "mu: GEM's proxy momentum, and the momentum rules'")


class MomentumRule(OverflowGuard, CommitRule):
    name = "momentum"
    options = (MOMENTUM,)

    def __init__(
        self, num_parameters: int, *, learning_rate: float, momentum: float, schedule: Schedule = constant_schedule
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        self.momentum = momentum
        self._velocity = np.zeros(num_parameters, dtype=np.float32)
        self._spare_velocity = np.empty(0, dtype=np.float32)  # the next velocity is written out of place here
        self._velocity_peak = 0.0  # a bound on max |velocity|

    def global_state(self, workers: bool = True) -> dict[str, np.ndarray]:
        return {"velocity": self._velocity.copy()}

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        velocity = state.get("velocity")
        if velocity is None or set(state) != {"velocity"} or velocity.shape != self._velocity.shape:
            raise ValueError(f"momentum rule state must be one 'velocity' of shape {list(self._velocity.shape)}")
        np.copyto(self._velocity, velocity)
        self._velocity_peak = max_abs(self._velocity)

    def step_scaled(
        self,
        theta: np.ndarray,
        update: np.ndarray,
        scale: float,
        context: StepContext,
    ) -> tuple[np.ndarray, ApplyStats]:
        update_peak = context.payload_peak
        velocity_bound = self.in_place_bound(
            abs(self.momentum) * self._velocity_peak, self.update_peak(update, scale, update_peak)
        )
        step_bound = self.step_bound(velocity_bound) if velocity_bound is not None else None
        bound = self.in_place_bound(self.peak_of(theta), step_bound) if step_bound is not None else None
        if bound is not None and velocity_bound is not None:  # cannot overflow
            delta = self.scaled(update, scale)
            self._velocity *= np.float32(self.momentum)
            self._velocity += delta
            self.move(theta, self._velocity, delta, theta)
            self._velocity_peak = velocity_bound
            self.remember_peak(theta, bound)
            return theta, ApplyStats.constant(1.0)
        if self._spare_velocity.shape != self._velocity.shape:
            self._spare_velocity = np.empty_like(self._velocity)
        velocity, updated = self._spare_velocity, self.take_spare(theta)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by checked()
            delta = self.scaled(update, scale)
            np.multiply(self._velocity, np.float32(self.momentum), out=velocity)
            velocity += delta
            self.move(theta, velocity, delta, updated)
        # theta's step is finite only where v is: one check covers the velocity too.
        updated = self.checked(theta, updated)
        self._velocity, self._spare_velocity = velocity, self._velocity
        self._velocity_peak = max_abs(velocity)
        return updated, ApplyStats.constant(1.0)

    def step_bound(self, velocity_bound: float) -> float | None:
        """A bound on max |theta's step| given one on max |v| (which bounds |Delta| too)."""
        return velocity_bound

    def move(self, theta: np.ndarray, velocity: np.ndarray, delta: np.ndarray, out: np.ndarray) -> None:
        """out <- theta + v (out may be theta)."""
        np.add(theta, velocity, out=out)


class NesterovRule(MomentumRule):
    """theta <- theta + mu*v + Delta after v <- mu*v + Delta: the velocity applied as Nesterov's
    look-ahead (torch.optim.SGD(nesterov=True)'s step on a gradient -Delta)."""

    name = "nesterov"

    def step_bound(self, velocity_bound: float) -> float | None:
        return self.in_place_bound(abs(self.momentum) * velocity_bound, velocity_bound)

    def move(self, theta: np.ndarray, velocity: np.ndarray, delta: np.ndarray, out: np.ndarray) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            look_ahead = velocity * np.float32(self.momentum)
            look_ahead += delta
            np.add(theta, look_ahead, out=out)
