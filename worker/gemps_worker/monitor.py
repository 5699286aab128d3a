"""Reads a running server's /metrics for progress displays: figures over the last interval."""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, fields, replace

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Prometheus text exposition at `url` as {sample name: value summed over label sets}."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


def _interval_mean(before: dict[str, float], after: dict[str, float], metric: str) -> float:
    """Mean of a histogram's or summary's observations between two scrapes (NaN if none)."""
    count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
    total = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
    return total / count if count > 0 else math.nan


@dataclass(frozen=True)
class ServerFigures:
    """Means over the commits applied between two scrapes."""

    training_loss: float
    median_scaling: float  # mean over commits of each commit's median pi
    mean_scaling: float
    mean_staleness: float

    @classmethod
    def between(cls, before: dict[str, float], after: dict[str, float]) -> ServerFigures:
        return cls(
            _interval_mean(before, after, "gemps_training_loss"),
            _interval_mean(before, after, "gemps_commit_median_scaling_factor"),
            _interval_mean(before, after, "gemps_scaling_factor"),
            _interval_mean(before, after, "gemps_commit_staleness"),
        )

    def or_else(self, previous: ServerFigures) -> ServerFigures:
        """These figures, with those that had no commits to average taken from `previous`."""
        kept = {f.name: getattr(previous, f.name) for f in fields(self) if math.isnan(getattr(self, f.name))}
        return replace(self, **kept)

    @classmethod
    def unknown(cls) -> ServerFigures:
        return cls(math.nan, math.nan, math.nan, math.nan)
