"""docker-compose.yml with GEMPS_PARTITIONS=2, run for real with podman (as test_containers.py,
whose stack is down by the time this module runs: one stack at a time on this machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.container_stack import Stack, run, running_stack
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(900)  # builds the images when test_containers.py did not run first


@pytest.fixture
def partitioned_stack() -> Iterator[Stack]:
    """The stack with θ in two server processes, 2 workers; up for one test only."""
    yield from running_stack("partitions", 2, GEMPS_PARTITIONS="2")


def test_two_partitions_train_through_the_containers(partitioned_stack: Stack) -> None:
    """GEMPS_PARTITIONS=2: the ps container runs two server processes; workers, given ps:50051
    only, commit to both; Prometheus scrapes both through the one server target."""
    stack = partitioned_stack
    status = stack.wait_for_workers(2)
    assert status.layout is not None and len(status.layout.partitions) == 2
    evaluation = stack.wait_for_evaluation(0.9)
    assert evaluation.version > 0
    wait_for(
        lambda: (
            stack.query("sum(gemps_partition_up)") == 2
            and (stack.query('gemps_central_version{partition="1"}') or 0) > 0
        ),
        120,
        "Prometheus to scrape both partitions",
        poll=1.0,
        tolerate=(Exception,),
        explain=stack.diagnostics,
    )
    (ps,) = stack.containers("ps")
    logs = run(["podman", "logs", ps], 60)
    assert "gemps.server[partition 1]: worker joined" in logs.stdout + logs.stderr
