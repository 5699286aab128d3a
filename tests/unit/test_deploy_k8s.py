"""The Kubernetes manifests (deploy/k8s and its replicas overlay, deploy/k8s-replicas) validate
with kubernetes-validate and have the shape the pods need: each pod's configuration, as `gemps
server` reads it from that pod's environment, is valid, and replicas find etcd and each other.
The container files (Dockerfiles, compose): test_deploy_manifests.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from gemps_cli.server import parse_config

from gemps import __version__

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
K8S_REPLICAS = DEPLOY / "k8s-replicas"  # an overlay of K8S (kustomize refuses one inside its base)
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are for (gRPC probes: GA in 1.27)
VERSION = __version__  # image tags follow the package version


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


# ---- Kubernetes ------------------------------------------------------------------------------


def assert_valid(docs: list[tuple[Path, dict[str, Any]]]) -> None:
    """Each document validates against Kubernetes K8S_VERSION's schema (strict: no unknown fields)."""
    assert docs
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {error.message}")


def test_k8s_manifests_validate() -> None:
    assert_valid(k8s_documents())


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
    assert_valid(k8s_documents(K8S_REPLICAS))


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
