"""Overflow safety for the rules: commits that cannot overflow run in place, the others out of place.

A commit of finite values can still overflow float32 (3e38 times pi_max): it is refused with
NonFiniteUpdate and leaves theta and every worker's and the rule's state exactly as they were.
A rule changes nothing before it knows the commit is acceptable:
- in place, as before, when a bound shows no value can overflow: the rule keeps a bound on
  max |theta| (and on its own state's), and the caller passes max |payload|, which its
  finiteness check found in the same pass: no pass over theta is added;
- otherwise into spare buffers, checked for finiteness, and swapped in only if they pass (which
  also measures the peaks again, tightening bounds that grew loose over many commits).

`OverflowGuard` holds the buffers and bounds for that; a rule mixes it in beside CommitRule
(`class MyRule(OverflowGuard, CommitRule)`). The interface itself (base.py) needs none of it.
"""

from __future__ import annotations

import math

import numpy as np

from gemps_server.domain.rules.base import NonFiniteUpdate
from gemps_server.native import max_abs

#: an update runs in place only when every value it computes is bounded by this: half of float32's
#: largest, a margin far beyond the rounding of the few float32 operations per parameter
SAFE_MAGNITUDE = float(np.finfo(np.float32).max) / 2
#: above 1 + the relative error of the float32 operations behind one value (each at most 2**-24)
ROUNDING = 1.0 + 2.0**-20


class OverflowGuard:
    """A rule's spare and scratch buffers, and its bound on max |theta|: what lets it apply a
    commit in place when no value can overflow, and otherwise out of place, checked."""

    # Instance attributes, set on first use (class-level defaults: no constructor to chain).
    _scratch: np.ndarray | None = None
    _spare: np.ndarray | None = None  # the next theta is written here (see CommitRule.step)
    _theta_peak: tuple[np.ndarray, float] | None = None  # a bound on max |theta| it last returned

    def take_spare(self, like: np.ndarray) -> np.ndarray:
        """A float32 buffer shaped like `like` for the next theta (the one handed back last, if any)."""
        spare, self._spare = self._spare, None
        if spare is None or spare.shape != like.shape:
            spare = np.empty(like.shape, dtype=np.float32)
        return spare

    def keep_spare(self, array: np.ndarray) -> None:
        """Keep `array` (the previous theta, or a refused result) for the next `take_spare`."""
        self._spare = array

    def checked(self, old: np.ndarray, new: np.ndarray, peak: float | None = None) -> np.ndarray:
        """`new` as the next theta when it is finite (the rule keeps `old` as its spare); otherwise
        keeps `new` as the spare and raises NonFiniteUpdate. `peak`: max_abs(new), where the pass
        that wrote it measured it."""
        peak = max_abs(new) if peak is None else peak  # NaN when a value is not
        if not math.isfinite(peak):
            self.keep_spare(new)
            raise NonFiniteUpdate("the update would make the central variable overflow to infinity (or NaN)")
        self.keep_spare(old)
        self.remember_peak(new, peak)
        return new

    def peak_of(self, theta: np.ndarray) -> float:
        """A bound on max |theta|: the one kept for the array this rule returned last, else one pass."""
        if self._theta_peak is not None and self._theta_peak[0] is theta:
            return self._theta_peak[1]
        return max_abs(theta)

    def remember_peak(self, theta: np.ndarray, peak: float) -> None:
        """`peak` bounds max |theta| for the array about to be returned."""
        self._theta_peak = (theta, peak)

    def theta_bound(self, theta: np.ndarray) -> float | None:
        """The bound kept for `theta`, if it is the array returned last (see CommitRule.theta_bound)."""
        return self._theta_peak[1] if self._theta_peak is not None and self._theta_peak[0] is theta else None

    def load_theta_bound(self, theta: np.ndarray, bound: float) -> None:
        """Keep `bound` for `theta`, raised to max |theta| if it is below (it came from elsewhere)."""
        self.remember_peak(theta, max(bound, max_abs(theta)))

    @staticmethod
    def in_place_bound(*terms: float) -> float | None:
        """The sum of `terms` (bounds on magnitudes), widened for rounding, when it stays below
        SAFE_MAGNITUDE, so the update cannot overflow and may run in place; else None (NaN too)."""
        bound = sum(terms) * ROUNDING
        return bound if bound < SAFE_MAGNITUDE else None

    def update_peak(self, update: np.ndarray, scale: float, known: float | None) -> float:
        """A bound on max |scale * update|."""
        return abs(scale) * (max_abs(update) if known is None else known) * ROUNDING

    def scaled(self, update: np.ndarray, scale: float) -> np.ndarray:
        """scale * update in the rule's scratch buffer, or update itself when scale is 1."""
        if scale == 1.0:
            return update
        scaled: np.ndarray = np.multiply(update, np.float32(scale), out=self.scratch(update))
        return scaled

    def scratch(self, like: np.ndarray) -> np.ndarray:
        """A float32 buffer shaped like `like`, owned by the rule (allocated once)."""
        if self._scratch is None or self._scratch.shape != like.shape:
            self._scratch = np.empty(like.shape, dtype=np.float32)
        return self._scratch
