"""The Grafana dashboards and provisioning in deploy/: generated, well-formed, wired together.

Whether every query returns data from a real Prometheus is tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml
from gemps_cli.partitions import PartitionMetrics, PartitionProcess
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import heatmap, stat, timeseries
from grafana_foundation_sdk.models import prometheus as prometheus_models
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gemps_proto.reasons import Reason
from gemps_proto.status import RecentCommits, Rounds, WorkerStatus
from gemps_server.config import ServerConfig
from gemps_server.domain.rules import ApplyStats
from gemps_server.metrics import ServerMetrics
from gemps_server.replication.metrics import ReplicationCollector
from gemps_server.replication.status import PRIMARY, BackupLag, ReplicationStatus
from gemps_worker.metrics import WorkerMetrics
from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
PANEL_OPTIONS = {"timeseries": timeseries.Options, "heatmap": heatmap.Options, "stat": stat.Options}
GRID_WIDTH = 24


def load_generator() -> ModuleType:
    return load_script(GRAFANA / "generate.py", "gemps_grafana_generate")


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return load_generator()


def committed() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def test_committed_json_equals_a_fresh_generation(generator: ModuleType) -> None:
    fresh = {name: generator.render(model) for name, model in generator.dashboards().items()}
    assert sorted(fresh) == sorted(committed()), "dashboard files differ from the generator's"
    for name, text in fresh.items():
        assert committed()[name] == text, f"{name} is stale: run python deploy/grafana/generate.py"


def test_generator_check_mode_reports_stale_files(generator: ModuleType, tmp_path: Path) -> None:
    assert generator.main(["--check", "--out", str(tmp_path)]) == 1  # nothing there yet
    assert generator.main(["--out", str(tmp_path)]) == 0
    assert generator.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "gemps-server.json").write_text("{}")
    assert generator.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("name", sorted(committed()))
def test_dashboard_round_trips_through_the_sdk_models(name: str) -> None:
    """Decoding with grafana-foundation-sdk and encoding again changes nothing: no unknown or
    misspelled keys (the decoder drops them), every query decodes as a Prometheus query and
    every panel's options as its panel type's options."""
    register_default_plugins()
    text = committed()[name]
    model = dashboard_models.Dashboard.from_json(json.loads(text))
    assert json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n" == text
    for panel in model.panels or []:
        if isinstance(panel, dashboard_models.RowPanel):
            continue
        assert panel.type_val in PANEL_OPTIONS, panel.type_val
        assert isinstance(panel.options, PANEL_OPTIONS[panel.type_val]), panel.title
        assert panel.targets, f"panel {panel.title!r} has no query"
        for target in panel.targets:
            assert isinstance(target, prometheus_models.Dataquery), panel.title
            assert target.expr.strip(), panel.title


def test_the_round_trip_check_catches_a_misspelled_key() -> None:
    register_default_plugins()
    data = json.loads(committed()["gemps-server.json"])
    data["panels"][0]["targets"][0]["exprr"] = data["panels"][0]["targets"][0].pop("expr")
    model = dashboard_models.Dashboard.from_json(data)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) != data


def provisioned_datasource() -> dict[str, Any]:
    config = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert config["apiVersion"] == 1
    (datasource,) = config["datasources"]
    return dict(datasource)


@pytest.mark.parametrize("name", sorted(committed()))
def test_dashboard_is_wired_to_the_provisioned_datasource(name: str) -> None:
    text = committed()[name]
    assert "${" not in text and "__inputs" not in text, "import placeholders cannot be provisioned"
    dashboard = json.loads(text)
    datasource = provisioned_datasource()
    assert datasource["type"] == "prometheus" and datasource["uid"] == "gemps-prometheus"
    expected = {"type": "prometheus", "uid": datasource["uid"]}
    assert re.fullmatch(r"[a-z0-9-]{8,40}", dashboard["uid"])
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == expected, panel["title"]
        assert panel.get("description"), f"panel {panel['title']!r} needs a description (what it means)"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and all(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]


@pytest.mark.parametrize("name", sorted(committed()))
def test_panels_fit_the_grid_without_overlapping(name: str) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in panels(json.loads(committed()[name])):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= GRID_WIDTH, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def test_dashboards_cover_the_figures_the_issue_asks_for() -> None:
    titles = {panel["title"] for text in committed().values() for panel in panels(json.loads(text))}
    for wanted in (
        "Throughput",
        "Staleness distribution over time",
        "Median pi",
        "Training and held-out loss",
        "Held-out accuracy",
        "Active workers",
        "Commit latency p50 / p99",
        "Queue depth and applier utilisation",
        "Rejected commits by reason",
        "Proxy vs central energy",
    ):
        assert wanted in titles


REPLICATED_PRIMARY = ReplicationStatus(
    "r0", PRIMARY, epoch=4, replicas=3, backups=(BackupLag("r1", True, 0, 0.0), BackupLag("r2", False, 40, 2.5))
)


def exposed_sample_names() -> set[str]:
    """Sample names of a server's /metrics page after some traffic of every kind."""
    metrics = ServerMetrics()
    straggler = WorkerStatus("w0", 0, 3, 0.1, 0.1, RecentCommits(seconds=60.0, commits=3, scaling_mean=0.1))
    metrics.observe(
        version=lambda: 3,
        parameters=lambda: 10,
        rule_state_bytes=lambda: 80,
        active_workers=lambda: 1,
        queue_depth=int,
        workers=lambda: (straggler,),
        rounds=lambda: Rounds(closed=7, size=3, held=1),  # a rule of rounds' (adamw)
    )
    stats = ApplyStats.of(np.array([0.0, 1.0, 5.0], np.float32), 5.0, proxy_energy=0.1, central_energy=0.2)
    metrics.applied(2, stats, loss=0.5, num_samples=64, queued_seconds=1e-4, apply_seconds=2e-4)
    metrics.rejected(Reason.NON_FINITE)
    metrics.rpc("Commit", 0.001)
    metrics.message_received("Commit", 100)
    metrics.message_sent("Commit", 200)
    metrics.registered()
    metrics.departed("evicted")
    metrics.applier_ran(2e-4)
    metrics.evaluated("digits", 3, 0.4, 0.9)
    ReplicationCollector(metrics.registry, lambda: REPLICATED_PRIMARY)  # a primary exports every replication series
    worker = WorkerMetrics()  # the reference worker's own /metrics (gemps_worker_*)
    worker.step_duration.observe(0.01)
    worker.commits.inc()
    # `gemps server --partitions K`'s own (gemps_partition_up), here for a partition not answering.
    supervisor = CollectorRegistry()
    supervisor.register(PartitionMetrics([PartitionProcess(0, ServerConfig(), Path("unused.port"))]))
    text = "".join(generate_latest(r).decode() for r in (metrics.registry, worker.registry, supervisor))
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_a_dashboard_queries_is_exposed() -> None:
    exposed = exposed_sample_names() | {"up"}
    queried = {
        name
        for text in committed().values()
        for panel in panels(json.loads(text))
        for target in panel.get("targets", [])
        for name in re.findall(r"\b((?:gemps|process)_[a-z0-9_]+)\b", target["expr"])
    }
    assert len(queried) >= 20
    assert queried - exposed == set()


def test_prometheus_scrapes_the_jobs_the_dashboards_name() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    named = {job for text in committed().values() for job in re.findall(r'job="([^"]+)"', text)}
    assert named <= set(jobs)
    # Scaled compose services are found by DNS: one A record per replica.
    for job, service, port in (("gemps-server", "ps", 9109), ("gemps-worker", "worker", 9110)):
        (discovery,) = jobs[job]["dns_sd_configs"]
        assert discovery["names"] == [service] and discovery["type"] == "A" and discovery["port"] == port
    assert jobs["gemps-evaluator"]["dns_sd_configs"][0]["names"] == ["evaluator"]


def test_dashboard_provider_loads_the_dashboard_folder() -> None:
    config = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "gemps.yml").read_text())
    (provider,) = config["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# -- the Replication row --------------------------------------------------------------------------

REPLICATION_SERIES = {
    "gemps_replica_role",
    "gemps_replica_epoch",
    "gemps_replicas_configured",
    "gemps_replicas_live",
    "gemps_partition_under_replicated",
    "gemps_replication_lag_commits",
    "gemps_replication_lag_seconds",
    "gemps_replication_in_sync",
    "gemps_replication_forwarded_total",
    "gemps_replication_applied_total",
    "gemps_failovers_total",
}


def row_panels(dashboard: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels under the row `title`: inside it when collapsed, else those after it up to the next row."""
    top: list[dict[str, Any]] = dashboard["panels"]
    start = next(i for i, panel in enumerate(top) if panel["type"] == "row" and panel["title"] == title)
    if top[start].get("collapsed"):
        inside: list[dict[str, Any]] = top[start]["panels"]
        return inside
    rest = top[start + 1 :]
    return rest[: next((i for i, panel in enumerate(rest) if panel["type"] == "row"), len(rest))]


def test_the_replication_row_is_collapsed_so_a_stack_without_replicas_shows_no_empty_panels() -> None:
    """Issue 60, item 5: the replication panels read "No data" in the default stack."""
    top = json.loads(committed()["gemps-server.json"])["panels"]
    (row,) = [panel for panel in top if panel["type"] == "row" and panel["title"] == "Replication"]
    assert row["collapsed"] is True and len(row["panels"]) == 10
    assert top[-1] is row  # nothing after it: the panels above are every other row's


def replication_queries() -> dict[str, list[str]]:
    """Panel title -> its PromQL, for the server dashboard's Replication row."""
    return {
        panel["title"]: [target["expr"] for target in panel["targets"]]
        for panel in row_panels(json.loads(committed()["gemps-server.json"]), "Replication")
    }


def test_the_replication_row_shows_every_replication_series() -> None:
    queries = replication_queries()
    assert {
        "Under-replicated partitions",
        "Primaries per partition",
        "Epoch",
        "Failovers (1h)",
        "Replicas by role",
        "Epoch per replica",
        "Live replicas vs configured",
        "Journal entries forwarded and applied per second",
        "Replication lag (commits)",
        "Replication lag (seconds)",
    } <= set(queries)
    named = {name for exprs in queries.values() for e in exprs for name in re.findall(r"\bgemps_[a-z0-9_]+", e)}
    assert named == REPLICATION_SERIES


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not installed (Debian: apt-get install prometheus)"
        if os.environ.get("GEMPS_REQUIRE_PROMETHEUS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def for_promtool(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m")


def test_replication_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = [
        {"record": f"replication:query_{i}", "expr": for_promtool(expr)}
        for i, expr in enumerate(e for exprs in replication_queries().values() for e in exprs)
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "replication", "rules": rules}]}))
    checked = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(rules)} rules found" in checked.stdout
    # ... and a broken one is refused (the check parses the PromQL).
    path.write_text(yaml.safe_dump({"groups": [{"name": "r", "rules": [{"record": "r:q", "expr": "sum(("}]}]}))
    assert subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True).returncode != 0


def replication_page(status: ReplicationStatus) -> str:
    """The /metrics page of a server whose replication reports `status`."""
    metrics = ServerMetrics()
    ReplicationCollector(metrics.registry, lambda: status)
    return generate_latest(metrics.registry).decode()


def input_series(replicas: dict[str, ReplicationStatus]) -> list[dict[str, str]]:
    """promtool's input series: what each replica (instance -> record) exports, as partition 0,
    constant over the test (from the exposition itself: the names and labels are the real ones)."""
    series = []
    for instance, status in replicas.items():
        for family in text_string_to_metric_families(replication_page(status)):
            for sample in family.samples:
                if sample.name in REPLICATION_SERIES:
                    labels = {**sample.labels, "instance": instance, "partition": "0"}
                    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                    series.append({"series": f"{sample.name}{{{selector}}}", "values": f"{sample.value:g}x20"})
    return series


def test_replication_queries_read_a_primary_and_its_backups_right(tmp_path: Path) -> None:
    """The row's figures from a real PromQL engine (promtool's) over a primary with two backups, one
    lagging out of the in-sync set, and one of those backups reporting too."""
    backup = ReplicationStatus("r1", "backup", epoch=4, replicas=3, primary="a:50051", applied=100)
    series = input_series({"a": REPLICATED_PRIMARY, "b": backup})
    p0 = {"partition": "0"}

    def expect(expr: str, *samples: tuple[dict[str, str], float]) -> dict[str, Any]:
        listed = [
            {"labels": "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}", "value": value}
            for labels, value in samples
        ]
        return {"expr": for_promtool(expr), "eval_time": "2m", "exp_samples": listed}

    queries = {e for exprs in replication_queries().values() for e in exprs}
    checks = [
        expect("sum(gemps_partition_under_replicated)", ({}, 1)),
        expect('sum by (partition) (gemps_replica_role{role="primary"})', (p0, 1)),
        expect("max by (partition) (gemps_replica_epoch)", (p0, 4)),
        expect(
            "sum by (role, partition) (gemps_replica_role)",
            ({**p0, "role": "primary"}, 1),
            ({**p0, "role": "backup"}, 1),
            ({**p0, "role": "candidate"}, 0),
        ),
        expect("max by (partition) (gemps_replicas_live)", (p0, 2)),
        expect("max by (partition) (gemps_replicas_configured)", (p0, 3)),
        expect("sum by (partition) (1 - gemps_replication_in_sync)", (p0, 1)),
        expect(
            "gemps_replication_lag_commits",
            ({"__name__": "gemps_replication_lag_commits", "backup": "r1", "instance": "a", **p0}, 0),
            ({"__name__": "gemps_replication_lag_commits", "backup": "r2", "instance": "a", **p0}, 40),
        ),
    ]
    assert {check["expr"] for check in checks} <= queries  # the dashboard's own queries, not look-alikes
    tests = {"tests": [{"interval": "15s", "input_series": series, "promql_expr_test": checks}]}
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(tests))
    ran = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
