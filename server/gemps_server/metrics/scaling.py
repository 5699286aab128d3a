"""The commit rule's scaling of each applied commit: GEM's pi (constant for the other rules), how
much of it sits at a bound, and GEM's energies."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from gemps_server.domain.rules import ApplyStats
from gemps_server.metrics.accumulators import GaugeFamily, HistogramFamily, SummaryFamily

# GEM's pi is clamped to [0, pi_max] (default 5); the other rules scale by 1 or 1/(tau+1).
SCALING_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
ENERGY_SIDES = ("proxy", "central")


class ScalingMetrics:
    """Per-commit distributions of the rule's scaling, and the last commit's as gauges: all
    recorded per commit, so accumulators (accumulators.py), not prometheus_client's families."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.scaling = HistogramFamily(
            registry,
            "gemps_scaling_factor",
            "Mean per-parameter scaling (GEM's pi) of each applied commit.",
            SCALING_BUCKETS,
        )
        self.scaling_median_per_commit = HistogramFamily(
            registry,
            "gemps_commit_median_scaling_factor",
            "Median per-parameter scaling (GEM's pi) of each applied commit, over the parameters it moves.",
            SCALING_BUCKETS,
        )
        self.clamped = HistogramFamily(
            registry,
            "gemps_commit_clamped_ratio",
            "Fraction of the parameters a commit moves (Delta != 0) whose scaling sits at a bound (zero: pi=0, "
            "max: pi=pi_max), per commit.",
            RATIO_BUCKETS,
            ["bound"],
            [("zero",), ("max",)],
        )
        self._at_zero = self.clamped.child("zero")
        self._at_max = self.clamped.child("max")
        self.scaling_median = GaugeFamily(
            registry, "gemps_scaling_factor_median", "Median per-parameter scaling of the last commit."
        )
        self.scaling_at_zero = GaugeFamily(
            registry,
            "gemps_scaling_factor_at_zero_ratio",
            "Fraction of the parameters the last commit moves (Delta != 0) scaled by 0.",
        )
        self.scaling_at_max = GaugeFamily(
            registry,
            "gemps_scaling_factor_at_max_ratio",
            "Fraction of the parameters the last commit moves (Delta != 0) clamped at pi_max.",
        )
        # Series only for rules with energies: the sides are made at the first commit that has them.
        self.energy = SummaryFamily(
            registry,
            "gemps_gem_energy",
            "GEM's compliance condition per commit, averaged over parameters: side=proxy is kappa*|m_i|, "
            "side=central is |theta - s_i| + pi*|Delta| (the central variable's movement over the "
            "worker's round trip).",
            ["side"],
            capacity=len(ENERGY_SIDES),
        )
        self._sides: tuple[int, int] | None = None

    def applied(self, stats: ApplyStats) -> None:
        # Python floats: numpy's scalars (the fractions ApplyStats.of computes) compare and add slower.
        median, at_zero = float(stats.scaling_median), float(stats.fraction_at_zero)
        at_max = float(stats.fraction_at_max)
        self.scaling.observe(float(stats.scaling_mean))
        self.scaling_median_per_commit.observe(median)
        self.clamped.observe(at_zero, self._at_zero)
        self.clamped.observe(at_max, self._at_max)
        self.scaling_median.set(median)
        self.scaling_at_zero.set(at_zero)
        self.scaling_at_max.set(at_max)
        if math.isfinite(stats.proxy_energy) and math.isfinite(stats.central_energy):
            if self._sides is None:
                self._sides = (self.energy.child("proxy"), self.energy.child("central"))
            proxy, central = self._sides
            self.energy.observe(stats.proxy_energy, proxy)
            self.energy.observe(stats.central_energy, central)
