"""Reads a running server's figures for progress displays: Status RPC plus its /metrics page."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Prometheus text exposition at `url` as {sample name: value} (labels dropped, last wins)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@dataclass(frozen=True)
class ServerFigures:
    median_scaling: float
    mean_staleness: float

    @classmethod
    def from_metrics(cls, samples: dict[str, float]) -> ServerFigures:
        count = samples.get("gemps_commit_staleness_count", 0.0)
        staleness = samples.get("gemps_commit_staleness_sum", 0.0) / count if count else 0.0
        return cls(samples.get("gemps_scaling_factor_median", float("nan")), staleness)
