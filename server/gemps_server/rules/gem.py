"""Gradient Energy Matching (Hermans & Louppe 2018), computed on the server.

For worker i (m_i = 0 and s_i = theta when it registers), per commit with update Delta:

    m_i   <- mu * m_i + Delta                          proxy: i's momentum-SGD velocity
    c      = |theta - s_i|                             central movement since i's last commit
    pi     = clip((kappa*|m_i| - c) / (|Delta| + eps), 0, pi_max)
    s_i   <- theta                                      before applying
    theta <- theta + pi * Delta

This is the paper's Algorithm 1 with Appendix B's kappa, moved to the server, which already
holds theta and every commit: workers stay stateless.
"""

from __future__ import annotations

import numpy as np

from gemps_server.rules.base import ApplyStats, CommitRule, RuleParams

EPSILON = np.float32(1e-16)


class _WorkerState:
    __slots__ = ("last_seen_theta", "proxy")

    def __init__(self, theta: np.ndarray) -> None:
        self.proxy = np.zeros_like(theta)
        self.last_seen_theta = theta.copy()


class GemRule(CommitRule):
    name = "gem"
    vectors_per_worker = 2

    def __init__(self, params: RuleParams, num_parameters: int) -> None:
        super().__init__(params, num_parameters)
        self._workers: dict[str, _WorkerState] = {}
        # Scratch buffers reused by every commit: no allocation on the hot path.
        self._movement = np.empty(num_parameters, dtype=np.float32)
        self._scaling = np.empty(num_parameters, dtype=np.float32)

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:
        self._workers[worker_id] = _WorkerState(theta)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def apply(self, theta: np.ndarray, update: np.ndarray, worker_id: str, staleness: int) -> ApplyStats:
        state = self._workers[worker_id]
        p = self.params
        proxy, movement, scaling = state.proxy, self._movement, self._scaling
        proxy *= np.float32(p.momentum)
        proxy += update
        np.subtract(theta, state.last_seen_theta, out=movement)
        np.abs(movement, out=movement)
        np.abs(proxy, out=scaling)
        if p.kappa != 1.0:
            scaling *= np.float32(p.kappa)
        # The energies for metrics: reductions over buffers the rule fills anyway, no extra pass.
        size = max(1, scaling.size)
        proxy_energy = float(scaling.sum()) / size
        others_energy = float(movement.sum()) / size
        scaling -= movement
        denominator = movement  # movement is no longer needed: reuse its buffer
        np.abs(update, out=denominator)
        denominator += EPSILON
        with np.errstate(over="ignore"):  # a huge ratio is clipped to pi_max right after
            scaling /= denominator
        np.clip(scaling, 0.0, p.pi_max, out=scaling)
        # pi*(|Delta| + eps) summed: this commit's share of the central variable's movement.
        own_energy = float(np.dot(scaling, denominator)) / size
        stats = ApplyStats.of(scaling, p.pi_max, proxy_energy, others_energy + own_energy)
        np.copyto(state.last_seen_theta, theta)
        scaling *= update
        theta += scaling
        return stats
