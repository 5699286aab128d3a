"""Two separate `gemps server` jobs on one host (issue 61, item 9): each admitted what the whole
host could hold, the first's rule state being allocated lazily (together 4.1x the host in the
issue's probe). Now the second subtracts what the first claimed (memory_claims.py) and the two
together admit what one alone would; the first's claim goes with it when it stops."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

import gemps
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_worker.cluster import ServerProcess
from tests.integration.conftest import StartServerProcess, open_stub

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
P = 1 << 20  # θ of 4 MiB
HELD = 8 * P + 2 * P  # GEM's m_i and s_i, and a difference reply's bfloat16 copy: what a worker may hold
SLACK = 0.05  # the host's available memory moves between the two settlements (other processes)


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def settled(server: ServerProcess) -> int:
    """The server's budget once a first worker initialised θ (0 when it had no room for one)."""
    with gemps.Client(server.target, timeout=60) as client, contextlib.suppress(gemps.ResourceExhaustedError):
        client.register({"w": np.zeros(P, np.float32)})
    status = open_stub(server.target).Status(pb.StatusRequest(), timeout=30)
    return int(status.memory_budget_bytes)


def test_two_jobs_on_one_host_together_admit_what_one_alone_would(
    start_server_process: StartServerProcess, tmp_path: Path
) -> None:
    folder = tmp_path / "claims"
    workers = int(0.6 * available()) // HELD  # the first may hold 60% of the host
    options = {"rule": "gem", "memory_claims_dir": str(folder), "max_workers": workers, "max_message_mb": 16}
    first = start_server_process(**options)
    alone = settled(first)
    (path,) = folder.glob(f"{first.pid}.*.claim")
    claim = json.loads(path.read_text())
    assert claim["pid"] == first.pid and claim["bytes"] > workers * HELD
    second = start_server_process(**options)
    budget = settled(second)
    assert budget > 0 and workers * HELD + budget <= alone * (1 + SLACK), (alone, budget)
    assert f"claimed by 1 other gemps server (pid {first.pid})" in second.log()
    first.stop()
    assert not path.exists()  # withdrawn as it stopped
    third = start_server_process(**options)
    assert settled(third) >= alone - budget - 2 * SLACK * alone  # less the second's claim, not the first's
