"""Observability end to end: a real Prometheus scrapes a real training run; every dashboard query
is evaluated through its HTTP API and must return data. Also: promtool on the live /metrics page,
promtool on the project's scrape config, and JSON logs from a live server.

Prometheus and promtool come from Debian's `prometheus` package. Without them these tests skip,
unless GEMPS_REQUIRE_PROMETHEUS is set (CI sets it), where they fail instead.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

import gemps
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.status import PRIMARY, BackupLag, ReplicationStatus
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.replication.metrics import ReplicationCollector
from gemps_worker.cluster import ServerProcess
from tests.helpers import CommitLoops, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
# What Grafana substitutes for its interval variables; the test scrapes every second.
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "$__interval": "1s"}
WORKERS = 2
EPOCHS = 1000  # more than the test waits for: workers train until stopped with SIGTERM
MIN_COMMITS_PER_WORKER = 2  # Prometheus saw each worker's step count increase

T = TypeVar("T")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} not installed (Debian: apt-get install prometheus)"
        if os.environ.get("GEMPS_REQUIRE_PROMETHEUS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


# -- a live server with a little traffic (numpy client, no torch) ---------------------------------


def small_training(target: str, commits: int = 5) -> None:
    rng = np.random.default_rng(0)
    with gemps.Client(target, name="numpy-worker") as client:
        client.register({"w": np.zeros((10, 8), np.float32), "b": np.zeros(10, np.float32)})
        for _ in range(commits):
            gradient = {"w": rng.normal(size=(10, 8)).astype(np.float32), "b": np.ones(10, np.float32)}
            client.commit(gradient, loss=float(rng.random()), num_samples=64)
        client.report_evaluation(commits, loss=0.5, accuracy=0.75, num_samples=100, dataset="test-set")


def send_unknown_worker_commit(target: str) -> None:
    """One commit the server must refuse (reason unknown_worker)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        request = pb.CommitRequest(
            worker_id="no-such-worker",
            base_version=0,
            kind=pb.PAYLOAD_KIND_GRADIENT,
            payload=tensor_to_proto(np.zeros(4, np.float32)),
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.Commit(request)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_promtool_finds_nothing_wrong_with_live_metrics(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    with ServerProcess(rule="gem") as server:
        small_training(server.target)
        send_unknown_worker_commit(server.target)
        text = fetch(f"http://127.0.0.1:{server.metrics_port}/metrics")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
    # The page under test is the real one: it carries the figures of the traffic above.
    assert re.search(r'^gemps_commits_total\{outcome="applied",reason=""\} 5\.0$', text, re.M), text
    assert re.search(r'^gemps_commits_total\{outcome="rejected",reason="unknown_worker"\} 1\.0$', text, re.M)
    assert 'gemps_heldout_accuracy_ratio{dataset="test-set"} 0.75' in text
    assert re.search(r'^gemps_gem_energy_count\{side="proxy"\} 5\.0$', text, re.M)
    assert "_created" not in text  # no shadow series next to every counter


def test_promtool_finds_nothing_wrong_with_a_rule_of_rounds_page() -> None:
    """adamw's rounds (metrics/rounds.py): one worker, so each of its 5 commits closes a round."""
    promtool = require_tool("promtool")
    with ServerProcess(rule="adamw") as server:
        small_training(server.target)
        text = fetch(f"http://127.0.0.1:{server.metrics_port}/metrics")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
    for series in ("gemps_rounds_closed_total 5.0", "gemps_round_size 1.0", "gemps_round_held 0.0"):
        assert re.search(f"^{re.escape(series)}$", text, re.M), text


def test_project_scrape_config_passes_promtool() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_server_writes_one_json_object_per_line() -> None:
    with ServerProcess(rule="gem", log_format="json") as server:
        small_training(server.target, commits=2)
        send_unknown_worker_commit(server.target)
        server.stop()
        lines = [line for line in server.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON
    events = {record.get("event"): record for record in records}
    assert {"serving", "central variable initialised", "worker joined", "worker left", "rejected", "stopped"} <= set(
        events
    ), lines
    joined = events["worker joined"]
    assert joined["level"] == "info" and joined["logger"] == "gemps.server"
    assert joined["name"] == "numpy-worker" and joined["active"] == 1 and isinstance(joined["worker_id"], str)
    assert events["rejected"]["reason"] == "unknown_worker" and events["rejected"]["method"] == "Commit"
    assert events["worker left"]["commits"] == 2
    assert events["evaluation"]["held_out_accuracy"] == 0.75
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", joined["time"])


# -- a real Prometheus scraping a real training run --------------------------------------------------


class Prometheus:
    def __init__(self, binary: str, config: dict[str, Any], workdir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "prometheus.log"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def ready(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"prometheus exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            return fetch(self.url + "/-/ready", timeout=1.0).strip() != ""
        except OSError:
            return False

    def api(self, path: str, **params: str | float) -> Any:
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        reply = json.loads(fetch(f"{self.url}/api/v1/{path}?{query}"))
        assert reply["status"] == "success", reply
        return reply["data"]

    def instant(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def value(self, expr: str) -> float | None:
        result = self.instant(expr)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def scrape_config_for_test(targets: dict[str, list[str]]) -> dict[str, Any]:
    """The project's scrape config, each job's service discovery replaced by this test's targets."""
    config: dict[str, Any] = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert sorted(jobs) == sorted(targets), "the project's scrape jobs changed: update this test"
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) for every target of every panel."""
    found = []
    for path in DASHBOARDS:
        top = json.loads(path.read_text())["panels"]
        for panel in (inner for row in top for inner in (row, *row.get("panels", []))):  # a collapsed row's too
            for target in panel.get("targets", []):
                found.append((path.name, panel["title"], target["expr"]))
    return found


def to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
        for process in started:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def gemps_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemps_cli", *args]


@contextlib.contextmanager
def replica_exporter() -> Iterator[str]:
    """HOST:PORT of a /metrics page of the replication series a replicated partition's primary
    exports (its record built by hand, its forwarded count moving): this run's server is not
    replicated, and the dashboards' Replication row is checked for data like every other panel."""
    forwarded = itertools.count(step=5)
    backups = (BackupLag("r1", True, 0, 0.0), BackupLag("r2", False, 12, 0.8))

    def status() -> ReplicationStatus:
        return ReplicationStatus("r0", PRIMARY, epoch=3, replicas=3, backups=backups, forwarded=next(forwarded))

    registry = CollectorRegistry()
    ReplicationCollector(registry, status)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(5)


@pytest.mark.timeout(180)
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    binary = require_tool("prometheus")
    queries = dashboard_queries()
    assert len(queries) >= 20 and len(DASHBOARDS) >= 2
    logs = tmp_path / "logs"
    logs.mkdir()
    worker_ports = [free_port() for _ in range(WORKERS)]
    with (
        ServerProcess(rule="gem", log_path=logs / "server.log") as server,
        ServerProcess(rule="adamw", backup_workers=1, log_path=logs / "rounds-server.log") as rounds_server,
        processes() as children,
        replica_exporter() as replica,
    ):
        gem = f'instance="127.0.0.1:{server.metrics_port}"'  # the run's figures are the GEM server's
        prometheus_port = free_port()
        config = scrape_config_for_test(
            {
                # The rounds panels (adamw's) read a second, real server whose workers commit in rounds.
                "gemps-server": [
                    f"127.0.0.1:{server.metrics_port}",
                    replica,
                    f"127.0.0.1:{rounds_server.metrics_port}",
                ],
                "gemps-worker": [f"127.0.0.1:{port}" for port in worker_ports],
                "gemps-evaluator": [],  # `gemps evaluate` serves no /metrics yet
                "prometheus": [f"127.0.0.1:{prometheus_port}"],
            }
        )
        prometheus = Prometheus(binary, config, tmp_path, prometheus_port)
        try:
            wait_for(prometheus.ready, 30, "prometheus to start")
            started = time.time()
            wait_for(lambda: prometheus.value('up{job="gemps-server"}') == 1, 20, "a first scrape of the server")

            def run(name: str, *args: str) -> subprocess.Popen[bytes]:
                with open(logs / f"{name}.log", "wb") as log:
                    child = subprocess.Popen(gemps_command(*args), stdout=log, stderr=subprocess.STDOUT)
                children.append(child)
                return child

            workers = []
            for i, port in enumerate(worker_ports):
                args = ["--server", server.target, "--epochs", str(EPOCHS), "--name", f"w{i}", "--seed", str(i)]
                workers.append(run(f"worker{i}", "worker", *args, "--metrics-port", str(port)))
            run("evaluator", "evaluate", "--server", server.target, "--interval", "1")
            rounds = CommitLoops(
                [gemps.Client(rounds_server.target, name=f"r{i}") for i in range(3)],
                {"w": np.zeros(64, np.float32)},
                lambda: np.random.default_rng().standard_normal(64).astype(np.float32),  # a noise scale to sum
            ).start()
            with gemps.Client(server.target) as observer:
                wait_for(lambda: observer.status().initialized, 60, "the first registration")
            send_unknown_worker_commit(server.target)

            def check_workers_alive() -> None:
                for worker in workers:
                    if worker.poll() is not None:
                        pytest.fail(f"a worker stopped early:\n{_logs(logs)}")

            def workers_seen_training() -> bool:
                # Rate panels need two scrapes of each worker while its counters move: train until
                # Prometheus has seen that for every worker, however fast this machine is.
                check_workers_alive()
                moving = prometheus.instant(
                    'increase(gemps_worker_step_duration_seconds_count{job="gemps-worker"}[10s]) > 0'
                )
                # ... and the server's GEM histograms likewise (one scrape of them while they moved
                # left the energy panel without a rate once, with workers done in 1.5 s).
                energy = prometheus.instant('increase(gemps_gem_energy_count{job="gemps-server"}[10s]) > 0')
                # ... and the noise scale's gauges: NaN until enough windows are measured, and again once the
                # workers leave (on a loaded machine no scrape fell between the two once).
                noise = prometheus.instant('gemps_gradient_square{job="gemps-server"} > 0')
                # ... and the rounds of the adamw server while they closed.
                closing = prometheus.instant('increase(gemps_rounds_closed_total{job="gemps-server"}[10s]) > 0')
                return len(moving) == WORKERS and len(energy) > 0 and len(noise) > 0 and len(closing) > 0

            wait_for(workers_seen_training, 120, "prometheus to see every worker training", poll=0.5)
            rounds.stop()
            assert not rounds.failures, rounds.failures
            for worker in workers:  # SIGTERM: finish the step, leave cleanly, exit 0
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                assert worker.wait(timeout=60) == 0, _logs(logs)
            with gemps.Client(server.target) as observer:
                final_version = observer.status().version
            assert final_version >= WORKERS * MIN_COMMITS_PER_WORKER
            wait_for(
                lambda: (
                    prometheus.value(f"gemps_central_version{{{gem}}}") == final_version
                    and prometheus.value("max(gemps_heldout_evaluated_version)") is not None
                ),
                30,
                "prometheus to scrape the final version and an evaluation",
            )
            # A few seconds past now: a range query's last step can fall before a scrape the instant
            # query above already saw (the evaluator's first report, late on a loaded machine).
            end = time.time() + 5

            empty = []
            for dashboard, title, expr in queries:
                data = prometheus.api("query_range", query=to_promql(expr), start=started, end=end, step=1)
                values = [float(v) for series in data["result"] for _, v in series["values"]]
                if not any(math.isfinite(v) for v in values):
                    empty.append(f"{dashboard} / {title}: {expr} -> {len(data['result'])} series, no finite value")
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

            # Every metric the dashboards name exists in Prometheus (also those an `or` could hide).
            known = set(prometheus.api("label/__name__/values"))
            named = {m for _, _, expr in queries for m in re.findall(r"\b((?:gemps|process)_[a-z0-9_]+)", expr)}
            assert named - known == set()
            # The figures behind the panels are the run's own.
            rejected = prometheus.value(f'gemps_commits_total{{outcome="rejected",reason="unknown_worker",{gem}}}')
            assert rejected == 1
            assert prometheus.value(f'sum(gemps_commits_total{{outcome="applied",{gem}}})') == final_version
            assert prometheus.value(f"gemps_training_loss_count{{{gem}}}") == final_version
            assert prometheus.value(f"gemps_registrations_total{{{gem}}}") == WORKERS
            # Both workers were discovered and scraped while they trained.
            window = f"{int(end - started) + 5}s"
            scraped = prometheus.instant(f'max_over_time(up{{job="gemps-worker"}}[{window}])')
            assert sorted(float(s["value"][1]) for s in scraped) == [1.0] * WORKERS
            worker_series = prometheus.instant(
                f'last_over_time({{__name__=~"gemps_worker_.+", job="gemps-worker"}}[{window}])'
            )
            assert len({s["metric"]["instance"] for s in worker_series}) == WORKERS
        except BaseException:
            print(_logs(logs) + "\n--- prometheus ---\n" + prometheus.log_path.read_text())
            raise
        finally:
            prometheus.stop()


def _logs(folder: Path) -> str:
    return "\n".join(
        f"--- {path.name} ---\n{path.read_text(errors='replace')[-3000:]}" for path in sorted(folder.iterdir())
    )
