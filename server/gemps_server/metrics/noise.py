"""The gradient noise scale (domain/noise.py) of the values this server holds.

With partitions each one's are its slice's: the whole model's B_noise is
sum(gemps_gradient_noise_trace) / sum(gemps_gradient_square) over partitions. Every gauge here
is NaN while there is no estimate (GradientNoise.missing): no worker registered, or fewer than
MIN_NOISE_WINDOWS windows measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from gemps_proto.status import MIN_NOISE_WINDOWS, GradientNoise

_UNTIL = f"NaN while no worker is registered or before {MIN_NOISE_WINDOWS} windows"


class NoiseMetrics:
    """Gauges read from the live estimate at each scrape (NaN while there is none)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.noise_scale = Gauge(
            "gemps_gradient_noise_scale",
            f"Gradient noise scale B_noise = tr(Sigma)/|G|^2 in samples, from gradient commits ({_UNTIL}): "
            "about the critical batch size.",
            registry=registry,
        )
        self.useful_workers = Gauge(
            "gemps_useful_workers",
            f"B_noise / gemps_gradient_noise_batch_size: how many workers of that batch size pay ({_UNTIL}).",
            registry=registry,
        )
        self.noise_batch_size = Gauge(
            "gemps_gradient_noise_batch_size",
            "Samples per commit of the estimate: the last window's commits' num_samples (their harmonic mean; "
            f"the server's --batch-size for a commit that reports none) ({_UNTIL}).",
            registry=registry,
        )
        self.gradient_square = Gauge(
            "gemps_gradient_square",
            f"Moving average of the |G|^2 estimates (the noise scale's denominator; {_UNTIL}).",
            registry=registry,
        )
        self.noise_trace = Gauge(
            "gemps_gradient_noise_trace",
            f"Moving average of the tr(Sigma) estimates (the noise scale's numerator; {_UNTIL}).",
            registry=registry,
        )

    def observe(self, gradient_noise: Callable[[], GradientNoise], registered: Callable[[], float]) -> None:
        """Read the estimate, and the workers `registered`, at each scrape."""

        def reading(value: Callable[[GradientNoise], float]) -> Callable[[], float]:
            def read() -> float:
                noise = gradient_noise()
                return math.nan if noise.missing(int(registered())) else value(noise)

            return read

        self.noise_scale.set_function(reading(lambda noise: noise.scale))
        self.useful_workers.set_function(reading(lambda noise: noise.useful_workers))
        self.noise_batch_size.set_function(reading(lambda noise: noise.batch_size))
        self.gradient_square.set_function(reading(lambda noise: noise.gradient_square))
        self.noise_trace.set_function(reading(lambda noise: noise.noise_trace))
