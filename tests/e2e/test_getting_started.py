"""docs/getting-started.md's containers, run as the page writes them (issue 60, item 5), with
podman-compose standing in for `docker compose` as the page says: `up --scale worker=4`, `gemps
status`, `--scale worker=8`, `gemps export` and the podman teardown, in the page's order. Between
them: every panel of the dashboards (but the collapsed rows, Replication and Rounds, which have data
only with replicas and under `--rule adamw`) has data while training runs; the workers train for
the page's minutes; a server started again over the stack's checkpoints volume says it restored
one; and the teardown leaves no container, volume or network of the stack.

What differs from the page, and why: a project name and host ports of the test's own (other
stacks may run on this machine), the images built first with the workplace's torch pin
(container_stack.build), and `up` naming the services, as Grafana has no image in this workplace.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.container_stack import (
    COMPOSE_FILE,
    HOST_DATA_PORT,
    ROOT,
    SERVICES,
    Stack,
    built_stack,
    run,
    start,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(1500)  # builds the images when the source changed (minutes)

PAGE = ROOT / "docs" / "getting-started.md"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PAGE_ADDRESS = "127.0.0.1:50051"  # where the page's commands reach the server
# Grafana's $__rate_interval with Prometheus scraping every 5 s (deploy/prometheus): four scrapes.
RATE_INTERVAL = "20s"
# Each command of the page's container sections, by what it does, in the page's order.
EXPECTED = ["up 4", "status", "up 8", "export", "docker down", "podman rm", "podman-compose down"]


def page_commands() -> list[str]:
    """The commands of the page's bash blocks from "3. Train in containers" to "Where next"."""
    text = PAGE.read_text()
    section = text[text.index("## 3. Train in containers") : text.index("## Where next")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def kind(command: str) -> str:
    words = shlex.split(command, comments=True)
    if words[:3] == ["docker", "compose", "up"]:
        return f"up {words[words.index('--scale') + 1].removeprefix('worker=')}"
    if words[:3] == ["docker", "compose", "down"]:
        return "docker down"
    if words[0] == ".venv/bin/gemps":
        return words[1]
    return " ".join(words[:2])


def as_run_here(command: str, stack: Stack) -> list[str]:
    """The page's `command` as this test runs it: podman-compose for `docker compose`, the test's
    project and host port (module docstring)."""
    words = shlex.split(command, comments=True)
    compose = ["podman-compose", "-f", str(COMPOSE_FILE), "-p", stack.project]
    if words[:2] == ["docker", "compose"]:
        words = compose + words[2:] + (list(SERVICES) if words[2] == "up" else [])
    elif words[0] == "podman-compose":
        words = compose + words[1:]
    elif words[0] == "podman":
        words = [word.replace("gemps_ps_1", f"{stack.project}_ps_1") for word in words]
    elif words[0] == ".venv/bin/gemps":
        words = [
            sys.executable,
            "-m",
            "gemps_cli",
            *(w.replace(PAGE_ADDRESS, f"127.0.0.1:{stack.grpc_port}") for w in words[1:]),
        ]
    else:
        pytest.fail(f"the page runs {command!r}, which this test does not know: teach it", pytrace=False)
    return words


def panel_queries() -> dict[str, list[str]]:
    """'dashboard / panel' -> its PromQL, for every panel a user sees on opening the dashboards
    (a collapsed row's are inside it, hidden)."""
    found = {}
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            if panel.get("targets"):
                found[f"{path.stem} / {panel['title']}"] = [target["expr"] for target in panel["targets"]]
    return found


def without_data(stack: Stack) -> list[str]:
    """The panels none of whose queries has a finite value now."""
    empty = []
    for title, expressions in panel_queries().items():
        values = []
        for expression in expressions:
            promql = expression.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "5s")
            for series in stack.prometheus("/api/v1/query", query=promql)["result"]:
                values.append(float(series["value"][1]))
        if not any(math.isfinite(value) for value in values):
            empty.append(title)
    return empty


def test_the_getting_started_containers_run_as_written(tmp_path: Path) -> None:
    commands = page_commands()
    assert [kind(command) for command in commands] == EXPECTED, commands
    stack = built_stack("tutorial")  # the page's own variables: none set
    env = stack.env
    up, status, scale, export, _docker_down, podman_rm, compose_down = (as_run_here(c, stack) for c in commands)
    try:
        began = time.monotonic()
        start(stack, 4, [HOST_DATA_PORT], up=up)  # the page's `up`, again when a host port was held a moment
        stack.require_workers(4)
        stack.wait_for_workers(4)
        shown = run(status, 60).stdout
        assert "active workers  4" in shown and "restored" not in shown, shown

        # The dashboards fill while it trains: every panel a user sees on opening them has data.
        wait_for(
            lambda: not without_data(stack),
            300,
            "every dashboard panel to have data",
            poll=5.0,
            tolerate=(Exception,),
            explain=lambda: f"panels without data: {without_data(stack)}",
        )
        # Training lasts the page's minutes, whatever this machine's speed.
        for name in stack.containers("worker"):
            config = json.loads(run(["podman", "inspect", name], 60).stdout)[0]["Config"]["Env"]
            assert "GEMPS_MAX_SECONDS=600" in config, config
        # Past when the old page's training had ended (about 40 s after `up`), all 4 still train.
        time.sleep(max(0.0, 45.0 - (time.monotonic() - began)))
        assert stack.status().active_workers == 4

        run(scale, 600, env)
        stack.require_workers(8)
        stack.wait_for_workers(8)
        exported = subprocess.run(export, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert exported.returncode == 0 and (tmp_path / "model.safetensors").stat().st_size > 0, exported.stderr

        # The server started again over the checkpoints volume restores the newest: its log says
        # so at start, and `gemps status` shows it.
        (ps,) = stack.containers("ps")
        run(["podman", "restart", "-t", "30", ps], 120)
        wait_for(
            lambda: "restored" in run(status, 60).stdout,
            120,
            "status to show the restored checkpoint",
            poll=2.0,
            tolerate=(AssertionError, subprocess.TimeoutExpired),
            explain=stack.diagnostics,
        )
        logs = subprocess.run(["podman", "logs", ps], capture_output=True, text=True, timeout=60)
        assert "checkpoint restored" in logs.stdout + logs.stderr

        # The page's podman teardown leaves nothing of the stack.
        run(podman_rm, 180)
        run(compose_down, 300, env)
        assert not stack.leftovers(), f"the page's teardown left: {stack.leftovers()}"
    finally:
        if stack.leftovers():
            stack.down()
