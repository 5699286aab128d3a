"""A Prometheus file-based service discovery list (`file_sd_configs`) of a run's metrics endpoints.

Each target carries its `job` label (gemps-server, gemps-worker, gemps-evaluator: the job names
deploy/prometheus/prometheus.yml and the dashboards use), so one scrape job reading the file
yields the same series as the compose set-up. Prometheus re-reads the file when it changes; it is
replaced in one rename, never seen half-written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

SERVER_JOB = "gemps-server"
WORKER_JOB = "gemps-worker"
EVALUATOR_JOB = "gemps-evaluator"


@dataclass(frozen=True)
class ScrapeTarget:
    address: str  # HOST:PORT of a /metrics endpoint
    job: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def as_group(self) -> dict[str, object]:
        return {"targets": [self.address], "labels": {"job": self.job, **self.labels}}


def write_targets(path: Path, targets: Iterable[ScrapeTarget]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([target.as_group() for target in targets], indent=1) + "\n")
    tmp.replace(path)
