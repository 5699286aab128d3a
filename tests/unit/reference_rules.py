"""Plain reference implementations of DESIGN §1 (docs/DESIGN.md), written for clarity, not speed.

Each keeps its own copy of theta and version and computes every step from scratch in float32,
the way the design states it; the server's in-place implementation must agree to rounding.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
EPS = F32(1e-16)


class ReferenceServer:
    """Server-side rules exactly as DESIGN §1 writes them."""

    def __init__(
        self,
        rule: str,
        theta0: np.ndarray,
        eta: float,
        mu: float,
        kappa: float,
        pi_max: float,
        *,
        dn_learning_rate: float = 0.7,
        nesterov_period: float = 0,
        momentum_activation: float = 0.0,
        decayed: np.ndarray | None = None,
    ) -> None:
        self.rule = rule
        self.theta = theta0.astype(F32).copy()
        self.version = 0
        self.eta, self.mu, self.kappa, self.pi_max = F32(eta), F32(mu), F32(kappa), F32(pi_max)
        self.m: dict[str, np.ndarray] = {}
        self.s: dict[str, np.ndarray] = {}
        self.v = np.zeros_like(self.theta)
        # delayed-nesterov: epsilon, N (0: the workers registered), c; the buffer b and its count k
        self.epsilon, self.period, self.activation, self.beta = (
            dn_learning_rate,
            nesterov_period,
            momentum_activation,
            mu,
        )
        self.b = np.zeros_like(self.theta)
        self.k = 0
        # adamw, in float64 (torch.optim.AdamW's defaults): moments, steps, round's sum and start
        self.adam = AdamWReference(self.theta.size, decayed=decayed)

    def register(self, worker: str) -> None:
        self.m[worker] = np.zeros_like(self.theta)
        self.s[worker] = self.theta.copy()

    def leave(self, worker: str) -> None:
        del self.m[worker], self.s[worker]

    def commit(self, worker: str, payload: np.ndarray, base_version: int, is_gradient: bool = True) -> None:
        tau = self.version - base_version
        delta = (-self.eta * payload).astype(F32) if is_gradient else payload.astype(F32)
        if self.rule == "gem":
            self.m[worker] = self.mu * self.m[worker] + delta
            c = np.abs(self.theta - self.s[worker])
            pi = np.clip((self.kappa * np.abs(self.m[worker]) - c) / (np.abs(delta) + EPS), 0, self.pi_max)
            self.s[worker] = self.theta.copy()
            self.theta = self.theta + pi.astype(F32) * delta
        elif self.rule == "downpour":
            self.theta = self.theta + delta
        elif self.rule == "adaptive-staleness":
            self.theta = self.theta + delta / F32(tau + 1)
        elif self.rule == "momentum":
            self.v = self.mu * self.v + delta
            self.theta = self.theta + self.v
        elif self.rule == "nesterov":
            self.v = self.mu * self.v + delta
            self.theta = self.theta + (self.mu * self.v + delta)
        elif self.rule == "delayed-nesterov":
            self.delayed_nesterov(delta)
        elif self.rule == "adamw":  # every registered worker has an m here
            self.theta = self.adam.commit(
                self.theta,
                payload if is_gradient else -payload,
                base_version,
                self.version,
                len(self.m),
                float(self.eta),
            )
        else:
            raise ValueError(self.rule)
        self.version += 1

    def delayed_nesterov(self, delta: np.ndarray) -> None:
        """DESIGN §1's delayed-nesterov (Liu et al. 2024, Algorithm 3): v is m, b the buffer."""
        n = int(self.period) or max(1, len(self.m))  # every registered worker has an m here
        c = min(self.activation, 1.0 / n)
        self.b = self.b + delta
        self.k += 1
        if self.k >= n:
            self.v = self.mu * self.v + self.b / F32(n)
            weight = F32((1.0 - c * n + c) * self.beta)
            self.theta = (self.theta + F32(self.epsilon) * (delta / F32(n) + weight * self.v)).astype(F32)
            self.b = np.zeros_like(self.theta)
            self.k = 0
        else:
            self.theta = (self.theta + F32(self.epsilon) * (delta / F32(n) + F32(c * self.beta) * self.v)).astype(F32)


class AdamWReference:
    """DESIGN §1's adamw in float64: a round of K gradients on the round's θ (K the workers
    registered), their mean's torch.optim.AdamW step; a gradient older than the round, dropped.
    `decayed`: where the weight decay applies (the matrices'; everywhere when not given)."""

    def __init__(
        self,
        size: int,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        decay: float = 0.01,
        decayed: np.ndarray | None = None,
    ) -> None:
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.decay = decay * (np.ones(size) if decayed is None else decayed.astype(np.float64))
        self.m, self.v, self.total = np.zeros(size), np.zeros(size), np.zeros(size)
        self.steps = self.buffered = self.round_start = 0

    def commit(
        self, theta: np.ndarray, gradient: np.ndarray, base_version: int, version: int, workers: int, lr: float
    ) -> np.ndarray:
        if base_version < self.round_start:
            return theta
        self.total += gradient.astype(np.float64)
        self.buffered += 1
        if self.buffered < max(1, workers):
            return theta
        mean = self.total / self.buffered
        self.steps += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * mean
        self.v = self.beta2 * self.v + (1 - self.beta2) * mean**2
        m_hat, v_hat = self.m / (1 - self.beta1**self.steps), self.v / (1 - self.beta2**self.steps)
        moved = theta.astype(np.float64) * (1 - lr * self.decay) - lr * m_hat / (np.sqrt(v_hat) + self.eps)
        self.total[:] = 0.0
        self.buffered, self.round_start = 0, version + 1
        return moved.astype(F32)


class WorkerSideGemWorker:
    """The GEM reference code's worker-side computation, rearranged to run at commit time.

    In the reference code each worker keeps its own proxy m and the central variable it last
    read, pulls theta, computes pi itself and pushes pi*Delta; the central node only adds. Here
    the pull happens atomically with the commit (the server's view), which makes the two agree.
    """

    def __init__(self, theta_at_join: np.ndarray, eta: float, mu: float, kappa: float, pi_max: float) -> None:
        self.m = np.zeros_like(theta_at_join)
        self.previous_central = theta_at_join.copy()
        self.eta, self.mu, self.kappa, self.pi_max = F32(eta), F32(mu), F32(kappa), F32(pi_max)

    def scaled_update(self, central: np.ndarray, gradient: np.ndarray) -> np.ndarray:
        delta = (-self.eta * gradient).astype(F32)
        self.m = self.mu * self.m + delta
        movement = np.abs(central - self.previous_central)
        pi = np.clip((self.kappa * np.abs(self.m) - movement) / (np.abs(delta) + EPS), 0, self.pi_max)
        self.previous_central = central.copy()
        scaled: np.ndarray = pi.astype(F32) * delta
        return scaled


#: rules/overflow.py's: an update runs in place only below half of float32's largest; each bound
#: is widened by 1 + 2**-20 for float32's rounding
SAFE_MAGNITUDE = float(np.finfo(np.float32).max) / 2
ROUNDING = 1.0 + 2.0**-20


def gem_bounds(
    scale: float,
    payload_peak: float,
    theta_peak: float,
    momentum: float,
    kappa: float,
    pi_max: float,
    proxy_peak: float,
    last_seen_peak: float,
) -> tuple[float, float] | None:
    """GEM's bounds on max |theta| and max |m_i| after an in-place commit, None when a value it
    computes could reach SAFE_MAGNITUDE (DESIGN §1's overflow rule: csrc/gem_rule.c computes them)."""
    delta = abs(scale) * payload_peak * ROUNDING
    proxy = (abs(momentum) * proxy_peak + delta) * ROUNDING
    theta = (theta_peak + abs(pi_max) * delta) * ROUNDING
    largest = max(delta, proxy * max(1.0, abs(kappa)), theta_peak + last_seen_peak, theta)
    return (theta, proxy) if largest < SAFE_MAGNITUDE else None  # None for NaN too


def gem_stats(samples: np.ndarray, size: int, sums: tuple[float, ...]) -> tuple[float, ...]:
    """ApplyStats' six figures from a compiled GEM pass's sums (moving, pi_sum, at_zero, at_max,
    proxy_energy, central_energy) and pi's sample (NaN where Delta = 0): pi's over the `moving`
    parameters, the energies' over all `size` (csrc/gem_rule.c computes them)."""
    moving, pi_sum, at_zero, at_max, proxy_energy, central_energy = sums
    if moving == 0:  # nothing moved: no pi to speak of
        return 0.0, 0.0, 0.0, 0.0, proxy_energy / size, central_energy / size
    sample = np.sort(samples[~np.isnan(samples)])
    middle = sample.size // 2
    if sample.size == 0:
        median = pi_sum / moving
    elif sample.size % 2:
        median = float(sample[middle])
    else:
        median = (float(sample[middle - 1]) + float(sample[middle])) / 2
    return pi_sum / moving, median, at_zero / moving, at_max / moving, proxy_energy / size, central_energy / size
