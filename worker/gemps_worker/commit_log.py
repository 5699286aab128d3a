"""What workers saw of their commits, read while they train: one JSON line per commit reply.

Workers started with `--report-file` append a StepRecord per commit (its version, loss,
staleness and the scaling the server applied, all from the commit's reply). An observer tails
those files and averages the commits of each interval: the demo's progress line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from gemps_worker.training import StepRecord


class ReportTail:
    """The complete lines appended to a report file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read_new(self) -> list[StepRecord]:
        try:
            with open(self.path, "rb") as report:
                report.seek(self._offset)
                data = report.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        return [StepRecord(**json.loads(line)) for line in complete.splitlines() if line.strip()]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class CommitFigures:
    """Means over a set of commits (NaN where there were none)."""

    training_loss: float
    median_scaling: float  # mean over commits of each commit's median pi
    mean_scaling: float
    mean_staleness: float

    @classmethod
    def of(cls, records: Sequence[StepRecord]) -> CommitFigures:
        return cls(
            _mean([r.loss for r in records if math.isfinite(r.loss)]),
            _mean([r.scaling_median for r in records]),
            _mean([r.scaling_mean for r in records]),
            _mean([float(r.staleness) for r in records]),
        )

    def or_else(self, previous: CommitFigures) -> CommitFigures:
        """These figures, with those that had no commits to average taken from `previous`."""
        kept = {f.name: getattr(previous, f.name) for f in fields(self) if math.isnan(getattr(self, f.name))}
        return replace(self, **kept)

    @classmethod
    def unknown(cls) -> CommitFigures:
        return cls(math.nan, math.nan, math.nan, math.nan)
