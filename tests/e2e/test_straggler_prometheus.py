"""Issue 50, item 5, on the dashboard: a real Prometheus scrapes a real server whose one slowed
worker GEM damps, and the training dashboard's Stragglers panels, evaluated as Grafana sends
them, name it at rank 1 with pi near 0 and the highest staleness.

Prometheus comes from Debian's `prometheus` package: without it this skips, unless
GEMPS_REQUIRE_PROMETHEUS is set (CI sets it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_observability import DASHBOARDS, Prometheus, require_tool, to_promql
from tests.helpers import InProcessServer, free_port, wait_for
from tests.straggler_fleet import SLOW, StragglerFleet

pytestmark = pytest.mark.timeout(120)

PANELS = {
    "Most damped workers: mean pi": "gemps_damped_worker_scaling",
    "Most damped workers: staleness": "gemps_damped_worker_staleness",
    "Slowest workers: commits per second": "gemps_slowest_worker_commits_per_second",
}


def straggler_queries() -> dict[str, str]:
    """The Stragglers panels' PromQL, by panel title, as the committed dashboard holds them."""
    (training,) = [path for path in DASHBOARDS if path.name == "gemps-training.json"]
    found = {}
    for panel in json.loads(training.read_text())["panels"]:
        if panel["title"] in PANELS:
            (target,) = panel["targets"]
            found[panel["title"]] = to_promql(target["expr"])
    return found


def test_the_dashboard_names_the_slowed_worker_damped_from_a_real_prometheus(tmp_path: Path) -> None:
    binary = require_tool("prometheus")
    queries = straggler_queries()
    assert sorted(queries) == sorted(PANELS) and all(queries[title].startswith(PANELS[title]) for title in PANELS)
    with InProcessServer(rule="gem") as server, StragglerFleet(server.target) as fleet:
        port = free_port()
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "gemps-server", "static_configs": [{"targets": [f"127.0.0.1:{server.metrics_port}"]}]}
            ],
        }
        prometheus = Prometheus(binary, config, tmp_path, port)
        try:
            wait_for(prometheus.ready, 30, "prometheus to start")
            fleet.wait(5)

            def rank_one(title: str) -> dict[str, Any] | None:
                for series in prometheus.instant(queries[title]):
                    if series["metric"]["rank"] == "1":
                        return series
                return None

            def straggler_ranked_first() -> bool:
                return all((rank_one(title) or {}).get("metric", {}).get("worker") == SLOW for title in PANELS)

            wait_for(straggler_ranked_first, 30, "prometheus to see the straggler at rank 1", poll=0.5)
            damped = rank_one("Most damped workers: mean pi")
            stale = rank_one("Most damped workers: staleness")
            assert damped is not None and stale is not None
            assert float(damped["value"][1]) < 0.5 and float(stale["value"][1]) > 10, (damped, stale)
            # Three workers: three ranks a family, the fast ones behind it, each named.
            ranked = prometheus.instant(queries["Most damped workers: mean pi"])
            assert sorted(series["metric"]["rank"] for series in ranked) == ["1", "2", "3"], ranked
            assert {series["metric"]["worker"] for series in ranked} == {SLOW, "fast-a", "fast-b"}
        finally:
            prometheus.stop()
