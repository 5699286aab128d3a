"""A worker's own gradient sums, sent with an update commit (CommitRequest.gradient_sums).

The server estimates the gradient noise scale from gradient commits itself: k consecutive commits
of a small batch each, their mean one gradient at k times the batch (gemps_server.domain.noise).
An update commit (LocalSteps' window of local AdamW steps) carries no gradient, so the worker
measures its own steps' gradients g_i (gemps.pytorch.noise_sums) and the server folds the sums into
the same estimate (McCandlish et al. 2018, Appendix A):

    N = tr(Σ)/B ≈ Σ |g_{i-2} - 2 g_{i-1} + g_i|^2 / (6 · differences)
    |G|^2       ≈ Σ |g_i|^2 / steps - N

A worker's consecutive gradients are taken at a θ its own steps keep moving, and AdamW moves it
far: the plain two-batch estimate over 8 consecutive steps (|Σ g_i|^2 against Σ|g_i|^2) read that
drift as noise and put B/b at 47 on the character GPT where gradients drawn at one θ put it at 2.1
(docs/RESULTS.md, "The noise-scale gauge on LocalSteps' workers"). A second difference cancels
whatever part of the gradient changes linearly along the steps and keeps the batches' noise,
E|n_{i-2} - 2 n_{i-1} + n_i|^2 = 6 tr(Σ)/B, and there it read 2.5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GradientSums:
    """A window of `steps` local steps of one worker, on one server's slice of θ (gemps.v1.GradientSums)."""

    square_sum: float  # Σ_i |g_i|^2 over the window's steps
    difference_square: float  # Σ |g_{i-2} - 2 g_{i-1} + g_i|^2 over `differences` of its steps
    steps: int  # k: the window's local steps, at least 1
    differences: int  # how many second differences: 1 ... steps
    samples: int = 0  # the samples its steps trained on; 0: not known (the server's --batch-size a step)

    def problem(self) -> str:
        """Why a server refuses these sums, "" when it takes them."""
        if self.steps < 1:
            return f"gradient_sums.steps is {self.steps}: a window has at least one local step"
        if not 1 <= self.differences <= self.steps:
            return f"gradient_sums.differences is {self.differences}: one to steps ({self.steps}), one a step at most"
        for name, value in (("square_sum", self.square_sum), ("difference_square", self.difference_square)):
            if not (math.isfinite(value) and value >= 0.0):
                return f"gradient_sums.{name} must be a finite number >= 0, not {value!r}"
        return ""

    @property
    def noise(self) -> float:
        """N = tr(Σ)/B: the batches' noise, from the second differences."""
        return self.difference_square / (6.0 * self.differences)

    @property
    def gradient_square(self) -> float:
        """|G|^2: the steps' mean |g_i|^2 less the noise (negative where the noise dominates)."""
        return self.square_sum / self.steps - self.noise


def per_partition(sums: Sequence[GradientSums] | None, partitions: int) -> list[GradientSums | None]:
    """A commit's sums for each of its `partitions` servers, in θ order (None: not measured); a
    ValueError, before anything is sent, unless there is one per partition."""
    if sums is None:
        return [None] * partitions
    if len(sums) != partitions:
        raise ValueError(f"gradient_sums: {len(sums)} given for {partitions} partition(s) of θ: one per partition")
    return list(sums)
