"""Histogram bounds several concerns share: durations from microseconds (an apply of a small θ)
to seconds (a slow checkpoint or RPC)."""

from __future__ import annotations

DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
