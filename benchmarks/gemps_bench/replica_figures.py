"""The figures of `gemps bench --replicas` (gemps_bench.replicas): each run's CPU per commit of
the primary and its backups, and per (P, R) the medians over the repetitions and the ratio to R = 1."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from gemps_bench.results import LoadResult


def replica_figures(result: LoadResult, replicas: int) -> dict[str, Any]:
    """The primary's and the backups' CPU milliseconds per commit (the load measured each serving
    process as one entry of server_child_cpu_seconds, the primary first; with R = 1, the server)."""
    commits = result.commits
    if replicas == 1:
        primary = result.server_cpu_ms_per_commit
        backups: list[float] = []
    elif result.server_child_cpu_seconds and commits:
        primary, *rest = (1e3 * seconds / commits for seconds in result.server_child_cpu_seconds)
        backups = list(rest)
    else:
        primary, backups = math.nan, []
    return {
        "replicas": replicas,
        "primary_cpu_ms_per_commit": primary,
        "backup_cpu_ms_per_commit": max(backups) if backups else None,
    }


def _median(values: Sequence[float | None]) -> float:
    found = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(found) if found else math.nan


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (P, R): medians over the repetitions of commits/s and of the primary's and backup's CPU
    per commit, and the ratio to R = 1: the median of each repetition's own ratio (its R run over
    the R = 1 run of the same repetition), with their least and greatest."""
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["num_parameters"], run["replicas"]), []).append(run)
    rows = []
    for (size, replicas), found in sorted(cells.items()):
        single = {run["repeat"]: run for run in cells.get((size, 1), [])}
        ratios = [
            run["commits_per_second"] / single[run["repeat"]]["commits_per_second"]
            for run in found
            if run["repeat"] in single and single[run["repeat"]]["commits_per_second"] > 0
        ]
        rows.append(
            {
                "num_parameters": size,
                "replicas": replicas,
                "repeats": len(found),
                "commits_per_second": _median([run["commits_per_second"] for run in found]),
                "commits_per_second_each": [run["commits_per_second"] for run in found],
                "vs_single": statistics.median(ratios) if ratios else math.nan,
                "vs_single_range": [min(ratios), max(ratios)] if ratios else None,
                "primary_cpu_ms_per_commit": _median([run["primary_cpu_ms_per_commit"] for run in found]),
                "backup_cpu_ms_per_commit": _median([run["backup_cpu_ms_per_commit"] for run in found]),
                "client_cpu_ms_per_commit": _median([run["client_cpu_ms_per_commit"] for run in found]),
                "latency_p50_ms": _median([run["latency_p50_ms"] for run in found]),
                "machine_busy_fraction": _median([run.get("machine_busy_fraction") for run in found]),
            }
        )
    return rows
