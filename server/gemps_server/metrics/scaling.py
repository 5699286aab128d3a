"""The commit rule's scaling of each applied commit: GEM's pi (constant for the other rules), how
much of it sits at a bound, and GEM's energies."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Gauge, Histogram, Summary

from gemps_server.domain.rules import ApplyStats

# GEM's pi is clamped to [0, pi_max] (default 5); the other rules scale by 1 or 1/(tau+1).
SCALING_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ScalingMetrics:
    """Per-commit distributions of the rule's scaling, and the last commit's as gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.scaling = Histogram(
            "gemps_scaling_factor",
            "Mean per-parameter scaling (GEM's pi) of each applied commit.",
            buckets=SCALING_BUCKETS,
            registry=registry,
        )
        self.scaling_median_per_commit = Histogram(
            "gemps_commit_median_scaling_factor",
            "Median per-parameter scaling (GEM's pi) of each applied commit, over the parameters it moves.",
            buckets=SCALING_BUCKETS,
            registry=registry,
        )
        self.clamped = Histogram(
            "gemps_commit_clamped_ratio",
            "Fraction of the parameters a commit moves (Delta != 0) whose scaling sits at a bound (zero: pi=0, "
            "max: pi=pi_max), per commit.",
            ["bound"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self._at_zero = self.clamped.labels("zero")
        self._at_max = self.clamped.labels("max")
        self.scaling_median = Gauge(
            "gemps_scaling_factor_median", "Median per-parameter scaling of the last commit.", registry=registry
        )
        self.scaling_at_zero = Gauge(
            "gemps_scaling_factor_at_zero_ratio",
            "Fraction of the parameters the last commit moves (Delta != 0) scaled by 0.",
            registry=registry,
        )
        self.scaling_at_max = Gauge(
            "gemps_scaling_factor_at_max_ratio",
            "Fraction of the parameters the last commit moves (Delta != 0) clamped at pi_max.",
            registry=registry,
        )
        self.energy = Summary(
            "gemps_gem_energy",
            "GEM's compliance condition per commit, averaged over parameters: side=proxy is kappa*|m_i|, "
            "side=central is |theta - s_i| + pi*|Delta| (the central variable's movement over the "
            "worker's round trip).",
            ["side"],
            registry=registry,
        )

    def applied(self, stats: ApplyStats) -> None:
        self.scaling.observe(stats.scaling_mean)
        self.scaling_median_per_commit.observe(stats.scaling_median)
        self._at_zero.observe(stats.fraction_at_zero)
        self._at_max.observe(stats.fraction_at_max)
        self.scaling_median.set(stats.scaling_median)
        self.scaling_at_zero.set(stats.fraction_at_zero)
        self.scaling_at_max.set(stats.fraction_at_max)
        if math.isfinite(stats.proxy_energy) and math.isfinite(stats.central_energy):
            self.energy.labels("proxy").observe(stats.proxy_energy)  # series only for rules with energies
            self.energy.labels("central").observe(stats.central_energy)
