"""Gradient Energy Matching (Hermans & Louppe 2018), computed on the server.

For worker i (m_i = 0 and s_i = theta when it registers), per commit with update Delta:

    m_i   <- mu * m_i + Delta                          proxy: i's momentum-SGD velocity
    c      = |theta - s_i|                             central movement since i's last commit
    pi     = clip((kappa*|m_i| - c) / (|Delta| + eps), 0, pi_max)
    s_i   <- theta                                      before applying
    theta <- theta + pi * Delta

This is the paper's Algorithm 1 with Appendix B's kappa, moved to the server, which already
holds theta and every commit: workers stay stateless.

Two kernels compute it, bit for bit alike (a test checks it):

- `compiled` (../_native.c, built with the package; the default when it is there): one pass over
  the parameters, without the GIL, that also sums the commit's statistics (pi's mean, clamped
  fractions, the energies) exactly over every parameter; pi's median comes from every
  stride-th parameter (STATS_SAMPLE_SIZE of them at most).
- `numpy`: block by block (BLOCK parameters at a time), so each block's fifteen numpy
  operations work on data that stays in the CPU cache and need no P-sized scratch vectors; its
  statistics come from pi at the same strided sample, computed before the update from the same
  inputs: exact up to STATS_SAMPLE_SIZE parameters, an estimate past it.

`auto` picks `compiled` when the extension was built (it is optional: a machine without a C
compiler still installs gemps) and `numpy` otherwise. docs/PERFORMANCE.md has the measurements.
"""

from __future__ import annotations

import numpy as np

from gemps_server.native import compiled
from gemps_server.rules import base
from gemps_server.rules.base import ApplyStats, CommitRule, Schedule, constant_schedule

EPSILON = np.float32(1e-16)
#: how GEM's update runs: `auto` (compiled if built, else numpy), `compiled`, `numpy`
GEM_KERNELS = ("auto", "compiled", "numpy")
#: parameters per block: 256 KiB per float32 vector, so a block's vectors stay in cache (fastest of 4K-1M here)
BLOCK = 65_536


class _WorkerState:
    __slots__ = ("last_seen_theta", "proxy")

    def __init__(self, theta: np.ndarray) -> None:
        # np.zeros, not zeros_like: calloc'd pages stay unmapped until the first commit writes
        # them, so registering does not hold this θ-sized vector beside the request's bytes.
        self.proxy = np.zeros(theta.shape, theta.dtype)
        self.last_seen_theta = theta.copy()


class GemRule(CommitRule):
    name = "gem"
    vectors_per_worker = 2

    def __init__(
        self,
        num_parameters: int,
        *,
        learning_rate: float,
        momentum: float,
        kappa: float,
        pi_max: float,
        schedule: Schedule = constant_schedule,
        kernel: str = "auto",
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        self.momentum, self.kappa, self.pi_max = momentum, kappa, pi_max
        self._workers: dict[str, _WorkerState] = {}
        block = min(BLOCK, max(1, num_parameters))
        # Block-sized scratch, reused by every block of every commit.
        self._delta, self._movement, self._pi, self._denominator = (np.empty(block, dtype=np.float32) for _ in range(4))
        self._stride = base.sample_stride(num_parameters)
        self._sampled = np.arange(0, num_parameters, self._stride)
        if kernel not in GEM_KERNELS:
            raise ValueError(f"unknown gem kernel {kernel!r}; valid: {', '.join(GEM_KERNELS)}")
        if kernel == "compiled" and compiled is None:
            raise ValueError("gem kernel 'compiled' is not built here (no C compiler at install?): use auto or numpy")
        self.kernel = "compiled" if kernel != "numpy" and compiled is not None else "numpy"
        self._samples = np.empty(self._sampled.size, dtype=np.float32)  # pi at the sampled parameters

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:
        self._workers[worker_id] = _WorkerState(theta)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def apply_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, worker_id: str, staleness: int
    ) -> ApplyStats:
        state = self._workers[worker_id]
        if theta.size == 0:
            return ApplyStats.constant(0.0)
        if self.kernel == "compiled":
            return self._apply_compiled(theta, state, update, scale)
        stats = self._sample_stats(theta, state, update, scale)  # before the update changes its inputs
        for start in range(0, theta.size, BLOCK):
            end = min(start + BLOCK, theta.size)
            self._apply_block(
                theta[start:end], state.proxy[start:end], state.last_seen_theta[start:end], update[start:end], scale
            )
        return stats

    def _apply_compiled(self, theta: np.ndarray, state: _WorkerState, update: np.ndarray, scale: float) -> ApplyStats:
        assert compiled is not None
        values = (scale, self.momentum, self.kappa, self.pi_max, EPSILON)
        pi_sum, at_zero, at_max, proxy_energy, central_energy = compiled.gem_update(
            theta, state.proxy, state.last_seen_theta, np.ascontiguousarray(update, np.float32),
            *(float(np.float32(v)) for v in values), self._stride, self._samples,
        )  # fmt: skip
        size = theta.size
        return ApplyStats(
            scaling_mean=pi_sum / size,
            scaling_median=base.median(self._samples),
            fraction_at_zero=at_zero / size,
            fraction_at_max=at_max / size,
            proxy_energy=proxy_energy / size,
            central_energy=central_energy / size,
        )

    def _sample_stats(self, theta: np.ndarray, state: _WorkerState, update: np.ndarray, scale: float) -> ApplyStats:
        """ApplyStats from pi at the sampled parameters (all of them up to STATS_SAMPLE_SIZE)."""
        at = self._sampled
        delta = update[at] * np.float32(scale)
        proxy = state.proxy[at]  # a copy (fancy indexing): moving it leaves the worker's proxy alone
        scratch = (np.empty_like(delta), np.empty_like(delta), np.empty_like(delta))
        self._scaling(theta[at], proxy, state.last_seen_theta[at], delta, scratch)
        pi, movement, denominator = scratch
        proxy_energy = np.abs(proxy)
        proxy_energy *= np.float32(self.kappa)
        # pi*(|Delta| + eps): this commit's share of the central variable's movement.
        central_energy = float(movement.mean(dtype=np.float64)) + float(np.dot(pi, denominator)) / pi.size
        return ApplyStats.of(pi, self.pi_max, float(proxy_energy.mean(dtype=np.float64)), central_energy)

    def _scaling(
        self,
        theta: np.ndarray,
        proxy: np.ndarray,
        last_seen: np.ndarray,
        delta: np.ndarray,
        out: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        """Moves the proxy (m <- mu*m + Delta, in place) and fills `out` = (pi, c, |Delta| + eps)."""
        pi, movement, denominator = out
        proxy *= np.float32(self.momentum)
        proxy += delta
        np.subtract(theta, last_seen, out=movement)
        np.abs(movement, out=movement)
        np.abs(proxy, out=pi)
        if self.kappa != 1.0:
            pi *= np.float32(self.kappa)
        pi -= movement
        np.abs(delta, out=denominator)
        denominator += EPSILON
        with np.errstate(over="ignore"):  # a huge ratio is clipped to pi_max right after
            pi /= denominator
        np.maximum(pi, np.float32(0.0), out=pi)  # maximum/minimum: np.clip is several times slower
        np.minimum(pi, np.float32(self.pi_max), out=pi)

    def _apply_block(
        self, theta: np.ndarray, proxy: np.ndarray, last_seen: np.ndarray, update: np.ndarray, scale: float
    ) -> None:
        """GEM on one block, in place."""
        n = theta.size
        delta, movement, pi = self._delta[:n], self._movement[:n], self._pi[:n]
        np.multiply(update, np.float32(scale), out=delta)
        self._scaling(theta, proxy, last_seen, delta, (pi, movement, self._denominator[:n]))
        np.copyto(last_seen, theta)
        np.multiply(pi, delta, out=movement)  # movement's buffer is free again
        theta += movement
