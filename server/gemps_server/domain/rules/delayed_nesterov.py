"""Delayed Nesterov (DN): Liu, Douillard et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling" (arXiv:2401.09135), Algorithm 3, the outer optimizer of asynchronous Local-SGD.

Each commit's Δ_t is a worker's accumulated local update θ_local - θ_pulled (the paper's
pseudo-gradient g_t with the opposite sign: Δ_t = -g_t), or -η·g for a gradient commit. With
the buffer b, the momentum m (both P-vectors, 0 at start) and k, the commits buffered since the
last momentum step:

    b ← b + Δ_t ;  k ← k + 1
    if k ≥ N:   m ← β·m + b/N
                θ ← θ + ε·((1 - c·N + c)·β·m + Δ_t/N) ;  b ← 0 ;  k ← 0
    else:       θ ← θ + ε·(c·β·m + Δ_t/N)

(the paper's m_{t+1} ← β·m_t + Δ/N and θ_{t+1} ← θ_t - ε·(… + g_t/N), m and g with our sign).
Every commit moves θ at once by its own share ε·Δ_t/N, a plain outer-SGD step, and the Nesterov
momentum, fed the mean of the N buffered updates, is applied only every N-th commit: over a
cycle θ moves by ε·(β·m + mean Δ), Nesterov's step on the average as synchronous Local-SGD
(DiLoCo) takes it, while no stale update is amplified by the momentum alone. c, the paper's
momentum activation (0 ≤ c ≤ 1/N, default 0), spreads a share c of the old momentum over each
commit in between; the shares of a cycle add up to one momentum step.

N is `nesterov_period`, or with 0 (the default, the paper's choice of N = number of workers) the
workers registered when a commit is applied: a cycle closes at the first commit that finds
k ≥ N, and with N from the registrations c is used as min(c, 1/N) (an explicit N with c above
1/N is refused at start). After a restore N is the checkpoint's until as many workers registered
again (or one left): the first one back takes its share of a cycle, not a cycle a commit.
"""

from __future__ import annotations

import math

import numpy as np

from gemps_proto.ranges import INT32_MAX, Range
from gemps_proto.rule_options import RuleOption
from gemps_proto.schema import POSITIVE_FACTOR
from gemps_server.domain.rules.base import (
    ApplyStats,
    CommitRule,
    NonFiniteUpdate,
    Schedule,
    StepContext,
    constant_schedule,
)
from gemps_server.domain.rules.momentum import MOMENTUM
from gemps_server.domain.rules.overflow import OverflowGuard
from gemps_server.domain.rules.registered import RegisteredWorkers
from gemps_server.native import max_abs

# Not "outer_learning_rate": that is the worker's flag (GEMPS_OUTER_LEARNING_RATE, what a worker
# multiplies its update by), and one variable may not mean two things to a server and its workers.
DN_LEARNING_RATE = RuleOption(
    "dn_learning_rate",
    0.7,
    POSITIVE_FACTOR,
    "epsilon: delayed-nesterov's outer learning rate (on every commit and its momentum steps)",
)
NESTEROV_PERIOD = RuleOption(
    "nesterov_period",
    0,
    Range(0, INT32_MAX),
    "N: delayed-nesterov's commits per momentum step; 0: the workers registered",
)
MOMENTUM_ACTIVATION = RuleOption(
    "momentum_activation",
    0.0,
    Range(0, 1),
    "c: delayed-nesterov's share of the momentum applied at each commit between its steps (at most 1/N)",
)

#: the rule's state, all of it outliving the workers' registrations (a checkpoint keeps it)
STATE = ("momentum", "buffer", "buffered")
#: N kept for the workers that register again after a restore (0: none); optional, since
#: checkpoints written before it lack it
KEPT_PERIOD = "period_kept"


class DelayedNesterovRule(RegisteredWorkers, OverflowGuard, CommitRule):
    name = "delayed-nesterov"
    options = (DN_LEARNING_RATE, MOMENTUM, NESTEROV_PERIOD, MOMENTUM_ACTIVATION)

    def __init__(
        self,
        num_parameters: int,
        *,
        learning_rate: float,
        dn_learning_rate: float,
        momentum: float,
        nesterov_period: int,
        momentum_activation: float,
        schedule: Schedule = constant_schedule,
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        if nesterov_period and momentum_activation * nesterov_period > 1:
            raise ValueError(
                f"momentum_activation {momentum_activation!r} is above 1/nesterov_period "
                f"(1/{nesterov_period}): the momentum's shares of a cycle would add up to more than one step"
            )
        self.dn_learning_rate = dn_learning_rate
        self.momentum = momentum
        self.nesterov_period = nesterov_period
        self.momentum_activation = momentum_activation
        self._momentum = np.zeros(num_parameters, dtype=np.float32)
        self._buffer = np.zeros(num_parameters, dtype=np.float32)
        self._buffered = 0  # k
        # The next momentum and buffer are written out of place here, and swapped in once θ is finite.
        self._spare_momentum = np.empty(0, dtype=np.float32)
        self._spare_buffer = np.empty(0, dtype=np.float32)
        self._step = np.empty(0, dtype=np.float32)

    def period(self) -> int:
        """N for the next commit: the option's, or the one a restore kept, or the workers
        registered (at least one)."""
        return self.nesterov_period or self.kept_group() or max(1, self.registered())

    def global_state(self, workers: bool = True) -> dict[str, np.ndarray]:
        kept = self.group_to_keep(workers, 0 if self.nesterov_period else self.period())
        return {
            "momentum": self._momentum.copy(),
            "buffer": self._buffer.copy(),
            "buffered": np.array(self._buffered, dtype=np.float32),
            KEPT_PERIOD: np.array(kept, dtype=np.float64),  # float64: any count exactly
        }

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        shape = list(self._momentum.shape)
        fits = set(state) - {KEPT_PERIOD} == set(STATE) and all(
            list(state[key].shape) == shape for key in ("momentum", "buffer")
        )
        # One number each: 0-d as global_state gives it, of shape [1] as a checkpoint file gives it back.
        counts = [state.get(key, np.zeros(1)) for key in ("buffered", KEPT_PERIOD)] if fits else [np.empty(0)] * 2
        buffered, kept = (float(count.reshape(-1)[0]) if count.size == 1 else math.nan for count in counts)
        if not (fits and all(count.is_integer() and count >= 0 for count in (buffered, kept))):
            raise ValueError(
                f"delayed-nesterov rule state must be 'momentum' and 'buffer' of shape {shape} and 'buffered' "
                f"(and {KEPT_PERIOD!r}), whole numbers >= 0; got {sorted(state)}"
            )
        np.copyto(self._momentum, state["momentum"])
        np.copyto(self._buffer, state["buffer"])
        self._buffered = int(buffered)
        self.keep_group(int(kept))

    def step_scaled(
        self,
        theta: np.ndarray,
        update: np.ndarray,
        scale: float,
        context: StepContext,
    ) -> tuple[np.ndarray, ApplyStats]:
        period = self.period()
        activation = min(self.momentum_activation, 1.0 / period)
        closes = self._buffered + 1 >= period  # this commit takes the momentum step
        momentum, buffer, step = self._spares()
        updated = self.take_spare(theta)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
            delta = self.scaled(update, scale)
            np.add(self._buffer, delta, out=buffer)
            np.divide(delta, np.float32(period), out=step)  # Δ_t/N
            if closes:
                np.multiply(self._momentum, np.float32(self.momentum), out=momentum)
                momentum += buffer / np.float32(period)
                weight = (1.0 - activation * period + activation) * self.momentum
            else:  # m stays as it is
                momentum = self._momentum
                weight = activation * self.momentum
            if weight:
                step += np.float32(weight) * momentum
            step *= np.float32(self.dn_learning_rate)
            np.add(theta, step, out=updated)
        if not (math.isfinite(max_abs(buffer)) and math.isfinite(max_abs(momentum))):
            self.keep_spare(updated)
            raise NonFiniteUpdate("the update would make delayed-nesterov's buffer or momentum overflow to infinity")
        updated = self.checked(theta, updated)  # raises with nothing changed when θ is not finite
        if closes:
            self._momentum, self._spare_momentum = momentum, self._momentum
            self._buffer.fill(0.0)
            self._spare_buffer = buffer
            self._buffered = 0
        else:
            self._buffer, self._spare_buffer = buffer, self._buffer
            self._buffered += 1
        return updated, ApplyStats.constant(self.dn_learning_rate / period)

    def _spares(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Buffers of P values for the next momentum, the next buffer and θ's step."""
        if self._spare_momentum.shape != self._momentum.shape:
            self._spare_momentum = np.empty_like(self._momentum)
        if self._spare_buffer.shape != self._buffer.shape:
            self._spare_buffer = np.empty_like(self._buffer)
        if self._step.shape != self._momentum.shape:
            self._step = np.empty_like(self._momentum)
        return self._spare_momentum, self._spare_buffer, self._step
