"""docker-compose.yml, run for real with podman (the stack: tests/e2e/container_stack.py): both
images are built from the compose file's own build sections, `podman-compose up --scale worker=4`
starts the server, the workers, the evaluator and Prometheus (all services but Grafana, which has
no image in this workplace), training progress is read through the server's Status RPC and
through Prometheus' HTTP API, workers are scaled down and up while training continues, and
everything is torn down. What the tests need, and when they skip: container_stack.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest
import yaml

from tests.e2e import container_stack
from tests.e2e.container_stack import (
    COMPOSE_FILE,
    WORKERS,
    Stack,
    require_base_images,
    require_podman,
    run,
    running_stack,
    scrape_jobs,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(900)  # the first test builds the images (minutes on a fresh machine)
LEASE_SECONDS = 600


@pytest.mark.parametrize("required", ["", "1"])
def test_a_base_image_no_registry_answers_for_skips_them_unless_required(
    monkeypatch: pytest.MonkeyPatch, required: str
) -> None:
    """A base image that is not here, on a registry that cannot be reached (a host under .invalid,
    which never resolves, as every registry is from this workplace): the container tests skip
    naming it, or with GEMPS_REQUIRE_CONTAINERS=1 fail."""
    require_podman()
    absent = "registry.gemps.invalid/gemps/absent:never"
    monkeypatch.setattr(container_stack, "base_images", lambda: [absent])
    monkeypatch.setenv("GEMPS_REQUIRE_CONTAINERS", required)
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match=f"base image {absent} is not present and no image registry is reachable") as said:
        require_base_images()
    # What to run is the repository's own script: no folder outside the repository (issue 60, item 6).
    assert "../" not in str(said.value) and "`tools/install-system-deps`" in str(said.value), said.value


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # A lease longer than any restart under load: only superseding can evict a killed worker here.
    yield from running_stack("e2e", WORKERS, GEMPS_LEASE_TTL=str(LEASE_SECONDS))


def image_of(service: str) -> str:
    image = yaml.safe_load(COMPOSE_FILE.read_text())["services"][service]["image"]
    assert isinstance(image, str)
    return image


def in_image(image: str, code: str) -> str:
    return run(["podman", "run", "--rm", "--entrypoint", "python", image, "-c", code], 300).stdout.strip()


def test_images_run_unprivileged_with_cpu_torch_only_in_the_worker(stack: Stack) -> None:
    server, worker = image_of("ps"), image_of("worker")
    for image in (server, worker):
        config = json.loads(run(["podman", "image", "inspect", image], 60).stdout)[0]
        print(f"{image}: {config['Size'] / 1e6:.0f} MB")
        assert config["Config"]["User"] == "10001:10001"
        healthcheck = config.get("Healthcheck") or config["Config"]["Healthcheck"]  # podman, docker
        assert "/opt/gemps/healthcheck.py" in " ".join(healthcheck["Test"])
    probe = "import importlib.util, os; print(importlib.util.find_spec('torch') is None, os.getuid())"
    assert in_image(server, probe) == "True 10001"  # the server image carries no torch
    assert in_image(worker, "import os, torch; print(torch.version.cuda, os.getuid())") == "None 10001"
    # and both run the compiled loops: a worker's int8 codes cost 3-7x the CPU through numpy's
    compiled = "from gemps_proto import compiled_codes; from gemps_server import native; "
    compiled += "print(compiled_codes.compiled is not None, native.compiled is not None)"
    assert in_image(worker, compiled) == in_image(server, compiled) == "True True"


def test_training_progresses_through_status_and_prometheus(stack: Stack) -> None:
    (ps,) = stack.containers("ps")
    # podman here has no systemd to run health checks on a timer: run the compose-defined one.
    wait_for(
        lambda: subprocess.run(["podman", "healthcheck", "run", ps], capture_output=True).returncode == 0,
        90,
        "the ps health check to pass",
        poll=1.0,
        tolerate=(Exception,),
        explain=stack.diagnostics,
    )
    status = stack.wait_for_workers(WORKERS)
    assert status.initialized and status.commits_applied >= 100
    evaluation = stack.wait_for_evaluation(0.9)
    assert evaluation.version > 0

    jobs = scrape_jobs()
    wait_for(
        lambda: stack.targets_up(jobs["ps"]) == 1 and stack.targets_up(jobs["worker"]) == WORKERS,
        120,
        f"Prometheus to scrape the server and {WORKERS} workers",
        poll=1.0,
        tolerate=(Exception,),
        explain=lambda: json.dumps(stack.prometheus("/api/v1/targets", state="active"), indent=1)[:4000],
    )
    seen = wait_for(
        lambda: stack.query("gemps_central_version"),
        60,
        "gemps_central_version in Prometheus",
        poll=1.0,
        tolerate=(Exception,),
    )
    wait_for(
        lambda: (stack.query("gemps_central_version") or 0) > seen,
        60,
        "gemps_central_version to grow",
        poll=1.0,
        tolerate=(Exception,),
    )
    assert (stack.query("sum(gemps_worker_commits_total)") or 0) > 0


def test_a_killed_worker_started_again_takes_its_own_place(stack: Stack) -> None:
    """A worker's process killed (as the kernel's out-of-memory killer ends one over its memory
    limit): compose's `restart: on-failure` starts the same container again, named after it, and the
    restart supersedes its dead registration in seconds, where an unnamed one held its slot and
    data shard for the lease."""
    stack.wait_for_workers(WORKERS)
    victim = stack.containers("worker")[0]
    hostname, pid = run(
        ["podman", "inspect", victim, "--format", "{{.Config.Hostname}} {{.State.Pid}}"], 60
    ).stdout.split()
    os.kill(int(pid), signal.SIGKILL)
    wait_for(
        lambda: int(run(["podman", "inspect", victim, "--format", "{{.RestartCount}}"], 60).stdout) >= 1,
        60,
        f"{victim} to be started again (restart: on-failure)",
        poll=1.0,
        explain=stack.diagnostics,
    )
    (ps,) = stack.containers("ps")

    def superseded() -> str | None:
        logs = run(["podman", "logs", ps], 60)
        lines = [line for line in (logs.stdout + logs.stderr).splitlines() if "worker evicted" in line]
        return next((line for line in lines if f"name={hostname}" in line), None)

    line = wait_for(
        superseded, 180, f"the server to evict {victim}'s dead registration", poll=1.0, explain=stack.diagnostics
    )
    assert "superseded by a newer registration of its name" in line, line
    stack.wait_for_workers(WORKERS, timeout=30)  # its restart in its place, not beside it


def test_workers_scale_down_and_up_while_training(stack: Stack) -> None:
    jobs = scrape_jobs()
    stack.wait_for_workers(WORKERS)
    # Down to 2, as `docker compose up -d --scale worker=2` does: stop the highest replicas.
    # (podman-compose cannot scale down.) SIGTERM: each finishes its step and leaves cleanly.
    leaving = stack.containers("worker")[2:]
    run(["podman", "stop", "-t", "20", *leaving], 120)
    for name in leaving:
        logs = run(["podman", "logs", name], 60)
        assert "stopped by signal" in logs.stdout + logs.stderr, name
    run(["podman", "rm", *leaving], 60)
    status = stack.wait_for_workers(2, timeout=60)  # they left: no lease to wait out
    wait_for(
        lambda: stack.targets_up(jobs["worker"]) == 2,
        90,
        "Prometheus to drop the stopped workers",
        poll=1.0,
        tolerate=(Exception,),
    )

    # Up to 6 while the other two keep training.
    stack.compose("up", "-d", "--no-deps", "--scale", "worker=6", "worker")
    stack.require_workers(6)
    grown = stack.wait_for_workers(6)
    assert grown.version > status.version
    assert len(stack.containers("worker")) == 6
    wait_for(
        lambda: stack.targets_up(jobs["worker"]) == 6,
        120,
        "Prometheus to scrape 6 workers",
        poll=1.0,
        tolerate=(Exception,),
    )

    stats = json.loads(
        run(["podman", "stats", "--no-stream", "--format", "json", *stack.containers("worker")], 60).stdout
    )
    for entry in stats:
        print(f"{entry['name']}: {entry['mem_usage']}")  # the containers guide's sizing advice comes from these
