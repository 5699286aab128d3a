"""The container stack the e2e container tests share: docker-compose.yml built and started for real
with podman (podman-compose), read through the server's Status RPC and Prometheus' HTTP API, and
torn down; and the checks that run before it (podman, the base images).

Needs podman and a podman-compose that honours --scale, 1.1 or later (tools/install-system-deps:
Debian's podman and PyPI's podman-compose, or in this workplace its container rig, which CI runs
first), and the base images the Dockerfiles and Prometheus start from: podman pulls them, or in
this workplace, which reaches no image registry, the rig builds stand-ins for them. What the tests
say to run names the repository's script, never a folder outside the repository. Without podman the tests
fail with one line saying which. Without the base images on a machine that reaches no registry
they skip with one line saying so (a newcomer's `make test` passes), unless
GEMPS_REQUIRE_CONTAINERS=1, which CI's .ci/run sets: there they fail. They skip on request with
GEMPS_SKIP_CONTAINER_TESTS=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
import yaml

import gemps
from gemps.records import Evaluation, ServerStatus
from gemps.retry import NO_RETRY
from tests.helpers import free_port, port_free, wait_for

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RIG = "tools/install-system-deps"  # podman, podman-compose and (here) the base images' stand-ins
HOST_DATA_PORT = 51051  # docker-compose.yml's GEMPS_HOST_DATA_PORT default
SERVICES = ("ps", "worker", "evaluator", "prometheus")  # not grafana: no image of it here
WORKERS = 4
# This workplace's only CPU PyTorch is a local torch==2.13.0 wheel that pip inside builds finds
# through the rig's pip configuration; the PyTorch index is unreachable. Users keep the defaults.
BUILD_ARGS = ("TORCH_REQUIREMENT=torch==2.13.0", "TORCH_INDEX_URL=")

T = TypeVar("T")


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def scrape_jobs() -> dict[str, str]:
    """Prometheus job name by compose service, from deploy/prometheus/prometheus.yml."""
    jobs = {}
    for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                jobs[name] = job["job_name"]
    return jobs


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    grpc_port: int
    prometheus_port: int
    services: ClassVar[tuple[str, ...]] = SERVICES  # what diagnostics report on

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run(["podman-compose", "-f", str(COMPOSE_FILE), "-p", self.project, *args], timeout, self.env)

    def containers(self, service: str, include_stopped: bool = False) -> list[str]:
        """Container names of one service, by replica number."""
        labels = [f"label=io.podman.compose.project={self.project}", f"label=com.docker.compose.service={service}"]
        args = ["podman", "ps", *(["-a"] if include_stopped else []), "--format", "json"]
        for label in labels:
            args += ["--filter", label]
        found = json.loads(run(args, 60).stdout or "[]")
        found.sort(key=lambda c: int(c["Labels"]["com.docker.compose.container-number"]))
        return [c["Names"][0] for c in found]

    def require_workers(self, count: int) -> None:
        """Right after `up --scale worker=N`: N worker containers, or fail now saying why (a
        podman-compose before 1.1 accepts --scale and starts one, without a word)."""
        started = len(self.containers("worker", include_stopped=True))
        if started != count:
            engine = run(["podman-compose", "--version"], 60).stdout.splitlines()[0]
            pytest.fail(
                f"`up --scale worker={count}` started {started} worker containers: {engine} ignores --scale "
                "(1.1 or later honours it; tools/install-system-deps installs one)",
                pytrace=False,
            )

    def status(self) -> ServerStatus:
        with gemps.Client(f"127.0.0.1:{self.grpc_port}", timeout=5.0, retry=NO_RETRY) as client:
            return client.status()

    def prometheus(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.prometheus_port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            reply = json.loads(response.read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def targets_up(self, job: str) -> int:
        targets = self.prometheus("/api/v1/targets", state="active")["activeTargets"]
        return sum(t["labels"]["job"] == job and t["health"] == "up" for t in targets)

    def query(self, expression: str) -> float | None:
        result = self.prometheus("/api/v1/query", query=expression)["result"]
        return float(result[0]["value"][1]) if result else None

    def diagnostics(self) -> str:
        """What the containers say, for failure messages."""
        lines = [run(["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}"], 60).stdout]
        for service in self.services:
            for name in self.containers(service, include_stopped=True)[:2]:
                logs = subprocess.run(["podman", "logs", "--tail", "15", name], capture_output=True, text=True)
                lines.append(f"--- {name}\n{logs.stdout}{logs.stderr}")
        return "\n".join(lines)

    def down(self) -> None:
        """Tear everything down, volumes included, whatever state the test left it in.

        Workers and the evaluator go first, as `docker compose down` does, so they leave while the
        server still answers. podman-compose's own `down` knows only the first replica of a
        scaled service, and cannot remove `ps` while replicas that depend on it exist.
        """
        replicas = self.containers("worker", include_stopped=True) + self.containers("evaluator", include_stopped=True)
        if replicas:
            subprocess.run(["podman", "stop", "-t", "20", *replicas], capture_output=True, timeout=120)
            subprocess.run(["podman", "rm", "-f", *replicas], capture_output=True, timeout=120)
        subprocess.run(
            ["podman-compose", "-f", str(COMPOSE_FILE), "-p", self.project, "down", "-v", "--remove-orphans"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            timeout=300,
        )

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=io.podman.compose.project={self.project}"
        found = []
        for command, field in ((["ps", "-a"], "Names"), (["volume", "ls"], "Name"), (["network", "ls"], "Name")):
            listing = run(["podman", *command, "--filter", label, "--format", f"{{{{.{field}}}}}"], 60)
            found += [f"{command[0]} {name}" for name in listing.stdout.split()]
        return found

    def wait_for_evaluation(self, accuracy: float, timeout: float = 180) -> Evaluation:
        """The evaluator's first report of at least `accuracy` held out."""
        evaluation: Evaluation = wait_for(
            lambda: e if (e := self.status().last_evaluation) is not None and e.accuracy >= accuracy else None,
            timeout,
            f"a held-out accuracy of {accuracy:.0%} from the evaluator",
            poll=1.0,
            tolerate=(Exception,),
            explain=self.diagnostics,
        )
        return evaluation

    def wait_for_workers(self, count: int, timeout: float = 300) -> ServerStatus:
        """`count` workers registered, and the version still moving."""
        status: ServerStatus = wait_for(
            lambda: s if (s := self.status()).active_workers == count else None,
            timeout,
            f"{count} active workers",
            poll=1.0,
            tolerate=(Exception,),
            explain=self.diagnostics,
        )
        moved: ServerStatus = wait_for(
            lambda: s if (s := self.status()).version >= status.version + 100 else None,
            120,
            "100 more commits",
            poll=1.0,
            tolerate=(Exception,),
            explain=self.diagnostics,
        )
        return moved


def require_podman() -> None:
    if os.environ.get("GEMPS_SKIP_CONTAINER_TESTS") == "1":
        pytest.skip("GEMPS_SKIP_CONTAINER_TESTS=1: container tests skipped on request")
    missing = [tool for tool in ("podman", "podman-compose") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: run `{RIG}` first (CI does)")


def qualified(image: str) -> str:
    """An image reference in full, as Docker reads a short one: python:3.11-slim is
    docker.io/library/python:3.11-slim, prom/prometheus:v2.53.0 is docker.io/prom/prometheus:v2.53.0."""
    first, _, rest = image.partition("/")
    if not rest:
        image = f"docker.io/library/{image}"
    elif "." not in first and ":" not in first and first != "localhost":
        image = f"docker.io/{image}"
    if ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
        image += ":latest"
    return image


def from_images(dockerfile: Path, build_args: dict[str, str]) -> list[str]:
    """The images a Dockerfile's FROM lines start from, its global ARGs resolved; not its own stages."""
    values: dict[str, str] = {}
    stages: set[str] = set()
    images: list[str] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        keyword = words[0].upper()
        if keyword == "ARG" and not images:  # ARGs before the first FROM are the ones FROM sees
            name, _, default = words[1].partition("=")
            values[name] = build_args.get(name, default)
        elif keyword == "FROM":
            words = [word for word in words[1:] if not word.startswith("--")]  # --platform=...
            image = re.sub(
                r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)",
                lambda m: values.get(m[1] or m[3]) or m[2] or "",
                words[0],
            )
            if image.lower() not in stages and image != "scratch":
                images.append(image)
            if len(words) == 3 and words[1].upper() == "AS":
                stages.add(words[2].lower())
    return images


def base_images() -> list[str]:
    """The images that `compose build` and `compose up` of SERVICES start from, in full."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    given = dict(arg.split("=", 1) for arg in BUILD_ARGS)
    images = []
    built = {service["image"] for service in services.values() if "build" in service}  # the evaluator runs the worker's
    for name in SERVICES:
        build = services[name].get("build")
        if build is None:
            if services[name]["image"] not in built:
                images.append(services[name]["image"])
            continue
        args = build.get("args") or {}
        if isinstance(args, list):
            args = dict(arg.split("=", 1) for arg in args if "=" in arg)
        dockerfile = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
        images += from_images(dockerfile, {**args, **given})
    return list(dict.fromkeys(map(qualified, images)))


# How podman says that it reached no registry (DNS, routing, refused, timed out), not that the
# registry refused the image.
UNREACHABLE = re.compile(
    r"pinging container registry|dial tcp|no such host|network is unreachable|no route to host|"
    r"connection refused|i/o timeout|TLS handshake timeout|proxyconnect"
)


def require_base_images() -> None:
    """The base images are here, or podman can pull them; else stop now, in one line, rather than
    minutes into a build that fails in its own words. A machine that reaches no registry and lacks
    them skips the container tests with that line (a newcomer's `make test`), unless
    GEMPS_REQUIRE_CONTAINERS=1 (CI's .ci/run): then they fail, so CI never passes without them."""
    for image in base_images():
        if subprocess.run(["podman", "image", "exists", image], capture_output=True, timeout=60).returncode == 0:
            continue
        absent = f"cannot build the images: base image {image} is not present and"
        try:
            pull = subprocess.run(["podman", "pull", "--quiet", image], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{absent} pulling it took over 300 s", pytrace=False)
        if pull.returncode == 0:
            continue
        if UNREACHABLE.search(pull.stderr):
            reason = f"no image registry is reachable from this machine; run `{RIG}` first"
            if os.environ.get("GEMPS_REQUIRE_CONTAINERS") == "1":
                pytest.fail(f"{absent} {reason} (GEMPS_REQUIRE_CONTAINERS=1)", pytrace=False)
            pytest.skip(f"{absent} {reason}")
        error = " ".join(pull.stderr.split()) or f"exit status {pull.returncode}"
        pytest.fail(f"{absent} pulling it failed: {error}", pytrace=False)


def start(stack: Stack, workers: int, data_ports: list[int], attempts: int = 3, up: list[str] | None = None) -> None:
    """`up` the stack (`up`: the command that does, by default `compose up -d --scale
    worker=<workers>` of SERVICES). The host keeps the data ports (51051 + i: the number the server
    announces), and in 4 full runs one was held for a moment around a stack's start ("address
    already in use": the previous stack's container monitor after its `down`, or a socket the
    kernel gave out before tests/reserved_ports.py kept them; not pinned down): wait for them, and
    start again after a `down` when it happens anyway."""
    for attempt in range(1, attempts + 1):
        wait_for(lambda: all(port_free(port) for port in data_ports), 60, f"host data ports {data_ports} free")
        try:
            if up is None:
                stack.compose("up", "-d", "--scale", f"worker={workers}", *SERVICES)
            else:
                run(up, 600, stack.env)
            return
        except AssertionError as failed:
            if "address already in use" not in str(failed) or attempt == attempts:
                raise
            print(f"{stack.project}: a host port was taken at up (attempt {attempt}); down and up again")
            stack.down()
            time.sleep(2)


_BUILT: set[str] = set()  # services whose images this test run built: the source does not change during it


def build(stack: Stack, *services: str) -> None:
    """Build the images of `services` (podman's cache keeps unchanged layers), once per test run."""
    if missing := [service for service in services if service not in _BUILT]:
        stack.compose("build", *(arg for a in BUILD_ARGS for arg in ("--build-arg", a)), *missing, timeout=840)
        _BUILT.update(missing)


def built_stack(name: str, **variables: str) -> Stack:
    """A stack of this test run's own (project name, host ports) with `variables` in its
    environment, its images built (cached after the first time); not started."""
    require_podman()
    require_base_images()
    grpc_port, prometheus_port = free_port(), free_port()
    env = {
        **os.environ,
        "BUILDAH_FORMAT": "docker",  # keep the Dockerfiles' HEALTHCHECK (OCI images have none)
        "GEMPS_HOST_PORT": str(grpc_port),
        "PROMETHEUS_HOST_PORT": str(prometheus_port),
        # A quarter of a core per worker (the stack's default is one): four to eight workers at a
        # core each took both of the suite's cores from the tests beside them (145 s of CPU in the
        # 88 s of the getting-started test alone), and none of these tests is about their speed.
        "GEMPS_WORKER_CPUS": "0.25",
        **variables,
    }
    stack = Stack(f"gemps-{name}-{os.getpid()}", env, grpc_port, prometheus_port)
    build(stack, "ps", "worker")
    return stack


def running_stack(name: str, workers: int, **variables: str) -> Iterator[Stack]:
    """Build the images (cached after the first time), start the stack with `workers` replicas
    and the extra `variables` in its environment, and tear it down after."""
    until_stopped = {"GEMPS_EPOCHS": "100000", "GEMPS_MAX_SECONDS": "0"}  # not the tutorial's 10 minutes
    stack = built_stack(name, **{**until_stopped, "GEMPS_EVAL_INTERVAL": "2", **variables})
    try:
        start(stack, workers, [HOST_DATA_PORT + i for i in range(int(variables.get("GEMPS_PARTITIONS", "1")))])
        stack.require_workers(workers)
        yield stack
    finally:
        stack.down()
        assert not stack.leftovers(), f"teardown left behind: {stack.leftovers()}"
