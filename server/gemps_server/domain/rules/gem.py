"""Gradient Energy Matching (Hermans & Louppe 2018), computed on the server.

For worker i (m_i = 0 and s_i = theta when it registers), per commit with update Delta:

    m_i   <- mu * m_i + Delta                          proxy: i's momentum-SGD velocity
    c      = |theta - s_i|                             central movement since i's last commit
    pi     = clip((kappa*|m_i| - c) / (|Delta| + eps), 0, pi_max)
    s_i   <- theta                                      before applying
    theta <- theta + pi * Delta

This is the paper's Algorithm 1 with Appendix B's kappa, moved to the server, which already
holds theta and every commit: workers stay stateless. Taking s_i before the step, c counts
worker i's own previous step too (as the authors' reference code does): with one worker GEM is
then not momentum SGD (DESIGN §1). `own_step="excluded"` takes s_i after the step instead, so c
counts only the other workers' steps (one more copy of theta per commit).

No commit can make theta, m_i or s_i NaN or infinite (finite payloads can overflow float32):
- `compiled` updates in place when a bound shows that no new value can come within a factor 2 of
  float32's largest (the bound takes max |theta|, max |m_i| and max |s_i| that the previous
  pass found in its cache, and max |payload| from the payload's finiteness check: no extra pass);
- otherwise, and always for `numpy`, the new theta and m_i go to two spare vectors and are kept
  only when every value is finite (else NonFiniteUpdate, with theta, m_i and s_i untouched).
  Keeping them is a swap of buffers: s_i takes the old theta's (s_i <- theta, without a copy),
  m_i the spare's, and the old s_i and m_i become the spares (2 vectors, allocated at the first
  such commit). Out of place costs about a third more time than in place: output pages are read
  before they are written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from gemps_server.domain.rules.base import (
    ApplyStats,
    CommitRule,
    NoiseWindow,
    NonFiniteUpdate,
    StepContext,
)
from gemps_server.domain.rules.gem_base import EPSILON, GEM_STATES, GemBase
from gemps_server.domain.rules.gem_compact import CompactGemRule
from gemps_server.native import all_finite, compiled, max_abs

#: parameters per block: 256 KiB per float32 vector, so a block's vectors stay in cache (fastest of 4K-1M here)
BLOCK = 65_536
#: what `worker_state` returns per worker: m_i, s_i and the bounds on their magnitudes
WORKER_STATE = ("proxy", "last_seen_theta", "proxy_peak", "last_seen_peak")


class _WorkerState:
    __slots__ = ("last_seen_peak", "last_seen_theta", "proxy", "proxy_peak")

    def __init__(self, theta: np.ndarray, theta_peak: float) -> None:
        # np.zeros, not zeros_like: calloc'd pages stay unmapped until the first commit writes
        # them, so registering does not hold this θ-sized vector beside the request's bytes.
        self.proxy = np.zeros(theta.shape, theta.dtype)
        self.last_seen_theta = theta.copy()
        self.proxy_peak = 0.0  # max |m_i|
        self.last_seen_peak = theta_peak  # max |s_i|


class GemRule(GemBase):
    """GEM with each worker's state exact (float32); the rule registered as "gem", whose `form` is
    the compact one where the server keeps the state in codes."""

    vectors_per_worker = 2
    state_form = "exact"

    @classmethod
    def form(cls, settings: Mapping[str, Any]) -> type[CommitRule]:
        """GEM's form for the server's --gem-state (exact, the default, or compact)."""
        state = settings.get("gem_state", "exact")
        forms: dict[str, type[CommitRule]] = {GemRule.state_form: GemRule, CompactGemRule.state_form: CompactGemRule}
        if state not in forms:
            raise ValueError(f"unknown gem state {state!r}; valid: {', '.join(GEM_STATES)}")
        return forms[state]

    def _allocate(self, num_parameters: int) -> None:
        self._workers: dict[str, _WorkerState] = {}
        # What the compiled commit core (csrc/core.c) runs itself: the compiled kernel, s_i taken
        # before the step; the other forms go through `step`.
        self.native_step = self.kernel == "compiled" and self.own_step == "counted"
        block = min(BLOCK, max(1, num_parameters))
        # Block-sized scratch, reused by every block of every commit.
        self._delta, self._movement, self._pi, self._denominator = (np.empty(block, dtype=np.float32) for _ in range(4))
        self._sampled = np.arange(0, num_parameters, self.sample_stride)
        self._spare_proxy: np.ndarray | None = None  # the next m_i is written here

    @property
    def writes_out(self) -> bool:
        return self.kernel == "compiled"  # the compiled pass writes it block by block, in cache

    @property
    def folds_noise(self) -> bool:
        return self.kernel == "compiled"  # the compiled pass sums |g|^2 while the payload is in cache

    @property
    def holds_payload(self) -> bool:
        return self.kernel == "compiled"  # the compiled pass reads each value once, held to the peak

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:
        self._workers[worker_id] = _WorkerState(theta, self.peak_of(theta) if self.kernel == "compiled" else 0.0)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def state_of(self, worker_id: str) -> _WorkerState:
        """Worker `worker_id`'s m_i and s_i and the bounds on them, as held (the compiled commit
        core moves them in place: csrc/core.c)."""
        return self._workers[worker_id]

    def worker_state(self, worker_id: str) -> dict[str, np.ndarray]:
        """m_i and s_i, and the bounds on their magnitudes the compiled kernel keeps."""
        state = self._workers[worker_id]
        return {
            "proxy": state.proxy.copy(),
            "last_seen_theta": state.last_seen_theta.copy(),
            "proxy_peak": np.array(state.proxy_peak, np.float64),
            "last_seen_peak": np.array(state.last_seen_peak, np.float64),
        }

    def load_worker_state(self, worker_id: str, state: dict[str, np.ndarray]) -> None:
        if set(state) != set(WORKER_STATE) or worker_id not in self._workers:
            raise ValueError(f"GEM's state of a registered worker is {', '.join(WORKER_STATE)}, got {sorted(state)}")
        vectors = state["proxy"], state["last_seen_theta"]
        if any(v.dtype != np.float32 or v.shape != (self.num_parameters,) for v in vectors):
            raise ValueError(f"GEM's m_i and s_i must be float32 of shape [{self.num_parameters}]")
        peaks = [np.asarray(state[name], np.float64).reshape(-1) for name in ("proxy_peak", "last_seen_peak")]
        if any(p.size != 1 or not 0.0 <= p[0] < math.inf for p in peaks):
            raise ValueError("GEM's peaks must be one finite, non-negative number each")
        loaded = self._workers[worker_id]
        loaded.proxy, loaded.last_seen_theta = (np.array(v, np.float32, copy=True) for v in vectors)
        # The compiled kernel runs in place on these bounds: one below the true peak (state from a
        # numpy kernel's rule keeps 0) is raised to it, so no overflow goes unchecked.
        compiled_kernel = self.kernel == "compiled"
        loaded.proxy_peak, loaded.last_seen_peak = (
            max(float(p[0]), max_abs(v)) if compiled_kernel else float(p[0])
            for p, v in zip(peaks, vectors, strict=True)
        )

    def step_scaled(
        self,
        theta: np.ndarray,
        update: np.ndarray,
        scale: float,
        context: StepContext,
    ) -> tuple[np.ndarray, ApplyStats]:
        worker_id, update_peak, out, window = context.worker_id, context.payload_peak, context.out, context.window
        state = self._workers[worker_id]
        if theta.size == 0:
            return theta, ApplyStats.constant(0.0)
        theta_peak = self.peak_of(theta) if self.kernel == "compiled" else 0.0
        bounds = self._bounds(theta_peak, state, update, scale, update_peak) if self.kernel == "compiled" else None
        held = -1.0 if update_peak is None else update_peak  # the compiled pass holds the payload to it
        if bounds is not None:
            finite, stats, _, _ = self._apply_compiled(theta, state, update, scale, None, None, out, window, held)
            assert finite, "GEM's bound let through a value that is not finite"
            state.proxy_peak, state.last_seen_peak = bounds[1], theta_peak
            if self.own_step == "excluded":  # s_i <- theta after the step
                np.copyto(state.last_seen_theta, theta)
                state.last_seen_peak = bounds[0]
            self.remember_peak(theta, bounds[0])
            return theta, stats
        theta_out, proxy_out = self.take_spare(theta), self._take_spare_proxy(theta)
        if self.kernel == "compiled":
            finite, stats, new_peak, proxy_peak = self._apply_compiled(
                theta, state, update, scale, theta_out, proxy_out, out, window, held
            )
        else:  # the base class measures a noise window after it (folds_noise is False)
            stats = self._sample_stats(theta, state, update, scale)  # from the same inputs as the update
            finite, new_peak, proxy_peak = True, 0.0, 0.0
            for start in range(0, theta.size, BLOCK):
                end = min(start + BLOCK, theta.size)
                finite = self._apply_block(
                    theta[start:end], state.proxy[start:end], state.last_seen_theta[start:end], update[start:end],
                    scale, theta_out[start:end], proxy_out[start:end],
                )  # fmt: skip
                if not finite:
                    break
        if not finite:
            self.keep_spare(theta_out)
            self._spare_proxy = proxy_out
            raise NonFiniteUpdate(
                "the update would make the central variable or the worker's GEM proxy overflow to infinity (or NaN)"
            )
        # s_i <- theta (the old theta's buffer), m_i <- its new values; the old ones are the next spares.
        self._spare_proxy = state.proxy
        if self.own_step == "excluded":  # s_i <- the new theta, copied into its own buffer
            np.copyto(state.last_seen_theta, theta_out)
            self.keep_spare(theta)
            theta_peak = new_peak
        else:
            self.keep_spare(state.last_seen_theta)
            state.last_seen_theta = theta
        state.proxy = proxy_out
        state.proxy_peak, state.last_seen_peak = proxy_peak, theta_peak
        if self.kernel == "compiled":  # the numpy kernel never runs in place: it needs no bounds
            self.remember_peak(theta_out, new_peak)
        return theta_out, stats

    def _bounds(
        self, theta_peak: float, state: _WorkerState, update: np.ndarray, scale: float, update_peak: float | None
    ) -> tuple[float, float] | None:
        """Bounds on max |theta| and max |m_i| after this commit when no value GEM computes for it
        can reach SAFE_MAGNITUDE (so none can overflow), else None: |Delta| <= |scale| max|u|,
        |m_i'| <= mu max|m_i| + |Delta|, pi <= pi_max, |theta - s_i| <= max|theta| + max|s_i|,
        |theta'| <= max|theta| + pi_max |Delta|. The bounds stand in for the peaks of the in-place
        pass (which does not measure them), widened by ROUNDING for float32's rounding; a bound
        that has grown too loose sends a commit out of place, which measures the peaks again.
        csrc/gem_rule.c's, the compiled commit core's own (tests/unit/reference_rules.py: in Python)."""
        assert compiled is not None
        payload_peak = max_abs(update) if update_peak is None else update_peak
        options = (self.momentum, self.kappa, self.pi_max)
        bounds: tuple[float, float] | None = compiled.gem_bounds(
            scale, payload_peak, theta_peak, *options, state.proxy_peak, state.last_seen_peak
        )
        return bounds

    def _take_spare_proxy(self, like: np.ndarray) -> np.ndarray:
        spare, self._spare_proxy = self._spare_proxy, None
        if spare is None or spare.shape != like.shape:
            spare = np.empty(like.shape, dtype=np.float32)
        return spare

    def _apply_compiled(
        self,
        theta: np.ndarray,
        state: _WorkerState,
        update: np.ndarray,
        scale: float,
        theta_out: np.ndarray | None,
        proxy_out: np.ndarray | None,
        out: np.ndarray | None = None,
        window: NoiseWindow | None = None,
        held: float = -1.0,
    ) -> tuple[bool, ApplyStats, float, float]:
        """The compiled pass (in place when `theta_out` is None; the new theta also to `out`; the
        noise `window`'s sums measured; each payload value read once, within [-held, held] when
        held >= 0): (all finite, statistics, max |new theta|, max |new m_i|)."""
        assert compiled is not None
        values = (scale, self.momentum, self.kappa, self.pi_max, EPSILON)
        total, stride, mode = (None, 1, 0) if window is None else (window.total, window.stride, window.mode)
        (finite, pi_sum, at_zero, at_max, proxy_energy, central_energy, theta_peak, proxy_peak, payload_square,
         window_square, moving) = compiled.gem_update(
            theta, state.proxy, state.last_seen_theta, np.ascontiguousarray(update, np.float32), theta_out, proxy_out,
            *(float(np.float32(v)) for v in values), self.sample_stride, self.samples, out, total, stride, mode, held,
        )  # fmt: skip
        if window is not None:
            window.payload_square, window.window_square = payload_square, window_square
        if not finite:  # refused: its statistics are never read
            return False, ApplyStats.constant(math.nan), theta_peak, proxy_peak
        stats = self.summed_stats(theta.size, moving, pi_sum, at_zero, at_max, proxy_energy, central_energy)
        return True, stats, theta_peak, proxy_peak

    def _sample_stats(self, theta: np.ndarray, state: _WorkerState, update: np.ndarray, scale: float) -> ApplyStats:
        """ApplyStats from pi at the sampled parameters (all of them up to STATS_SAMPLE_SIZE)."""
        at = self._sampled
        with np.errstate(over="ignore"):
            delta = update[at] * np.float32(scale)
        proxy = state.proxy[at]  # a copy (fancy indexing): moving it leaves the worker's proxy alone
        scratch = (np.empty_like(delta), np.empty_like(delta), np.empty_like(delta))
        self._scaling(theta[at], proxy, state.last_seen_theta[at], delta, scratch)
        pi, movement, denominator = scratch
        with np.errstate(over="ignore", invalid="ignore"):  # statistics of a commit refused for overflowing
            proxy_energy = np.abs(proxy)
            proxy_energy *= np.float32(self.kappa)
            # pi*(|Delta| + eps): this commit's share of the central variable's movement.
            central_energy = float(movement.mean(dtype=np.float64)) + float(np.dot(pi, denominator)) / pi.size
        return ApplyStats.of(pi, self.pi_max, float(proxy_energy.mean(dtype=np.float64)), central_energy, delta)

    def _scaling(
        self,
        theta: np.ndarray,
        proxy: np.ndarray,
        last_seen: np.ndarray,
        delta: np.ndarray,
        out: tuple[np.ndarray, np.ndarray, np.ndarray],
        proxy_out: np.ndarray | None = None,
    ) -> None:
        """Moves the proxy (m <- mu*m + Delta: into `proxy_out`, or in place) and fills
        `out` = (pi, c, |Delta| + eps)."""
        pi, movement, denominator = out
        moved = proxy if proxy_out is None else proxy_out
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused after the block
            np.multiply(proxy, np.float32(self.momentum), out=moved)
            moved += delta
            np.subtract(theta, last_seen, out=movement)
            np.abs(movement, out=movement)
            np.abs(moved, out=pi)
            if self.kappa != 1.0:
                pi *= np.float32(self.kappa)
            pi -= movement
            np.abs(delta, out=denominator)
            denominator += EPSILON
            pi /= denominator  # a huge ratio is clipped to pi_max right after
        np.maximum(pi, np.float32(0.0), out=pi)  # maximum/minimum: np.clip is several times slower
        np.minimum(pi, np.float32(self.pi_max), out=pi)

    def _apply_block(
        self,
        theta: np.ndarray,
        proxy: np.ndarray,
        last_seen: np.ndarray,
        update: np.ndarray,
        scale: float,
        theta_out: np.ndarray,
        proxy_out: np.ndarray,
    ) -> bool:
        """GEM on one block, into `theta_out` and `proxy_out`; False when a new value is not finite."""
        n = theta.size
        delta, movement, pi = self._delta[:n], self._movement[:n], self._pi[:n]
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(update, np.float32(scale), out=delta)
            self._scaling(theta, proxy, last_seen, delta, (pi, movement, self._denominator[:n]), proxy_out)
            np.multiply(pi, delta, out=movement)  # movement's buffer is free again
            np.add(theta, movement, out=theta_out)
        return all_finite(theta_out) and all_finite(proxy_out)
