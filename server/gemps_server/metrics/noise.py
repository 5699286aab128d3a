"""The gradient noise scale (domain/noise.py) of the values this server holds.

With partitions each one's are its slice's: the whole model's B_noise is
sum(gemps_gradient_noise_trace) / sum(gemps_gradient_square) over partitions.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from gemps_proto.status import GradientNoise


class NoiseMetrics:
    """Gauges read from the live estimate at each scrape (NaN until there is one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.noise_scale = Gauge(
            "gemps_gradient_noise_scale",
            "Gradient noise scale B_noise = tr(Sigma)/|G|^2 in samples, from gradient commits (NaN until "
            "estimated): about the critical batch size.",
            registry=registry,
        )
        self.useful_workers = Gauge(
            "gemps_useful_workers",
            "B_noise / gemps_gradient_noise_batch_size: how many workers of that batch size pay (NaN until estimated).",
            registry=registry,
        )
        self.noise_batch_size = Gauge(
            "gemps_gradient_noise_batch_size",
            "Samples per commit the noise scale assumes (the workers' reported num_samples, else the batch size).",
            registry=registry,
        )
        self.gradient_square = Gauge(
            "gemps_gradient_square",
            "Moving average of the |G|^2 estimates (the noise scale's denominator).",
            registry=registry,
        )
        self.noise_trace = Gauge(
            "gemps_gradient_noise_trace",
            "Moving average of the tr(Sigma) estimates (the noise scale's numerator).",
            registry=registry,
        )

    def observe(self, gradient_noise: Callable[[], GradientNoise]) -> None:
        self.noise_scale.set_function(lambda: gradient_noise().scale)
        self.useful_workers.set_function(lambda: gradient_noise().useful_workers)
        self.noise_batch_size.set_function(lambda: gradient_noise().batch_size)
        self.gradient_square.set_function(lambda: gradient_noise().gradient_square)
        self.noise_trace.set_function(lambda: gradient_noise().noise_trace)
