"""Two separate `gemps server` jobs on one host (issue 61, item 9): each admitted what the whole
host could hold, the first's rule state being allocated lazily (together 4.1x the host in the
issue's probe). Now the second subtracts what the first claimed (memory_claims.py) and the two
together admit what one alone would; the first's claim goes with it when it stops. And the shared
memory of a job's local workers is not what it took of its claim (issue 77, item 7)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gemps
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.memory_budget import RESERVED_BYTES, RESERVED_VECTORS
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
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


def settled(server: ServerProcess, parameters: int = P) -> int:
    """The server's budget once a first worker initialised θ (0 when it had no room for one)."""
    with gemps.Client(server.target, timeout=60) as client, contextlib.suppress(gemps.ResourceExhaustedError):
        client.register({"w": np.zeros(parameters, np.float32)})
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


# -- clients' shared memory is not a claim taken (issue 77, item 7) --------------------------------

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
HOST_LIMIT = 2048 * MIB  # the "host": a memory cgroup both servers run in
LOCAL_P = 4 << 20  # θ of 16 MiB: GEM's state 32 MiB a worker, its copy 8 MiB, its shared memory 16 MiB
LOCAL_HELD = 10 * LOCAL_P
RESERVE = RESERVED_VECTORS * 4 * LOCAL_P + RESERVED_BYTES


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder, where a child group can be made (root), else None."""
    if os.geteuid() != 0 or not (MEMORY_ROOT / "memory.limit_in_bytes").exists():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = MEMORY_ROOT / path.lstrip("/")
            return folder if folder.is_dir() else None
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A cgroup v1 memory group of `limit` bytes for the test's servers (skipped where none can be made)."""
    parent = own_memory_cgroup()
    if parent is None:
        pytest.skip("a host of known memory for two servers needs root and cgroup v1's memory controller")
    group = parent / f"gemps-test-claims-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group
    finally:  # its servers are stopped (and reaped) by then, unless one failed to start: killed here
        deadline = time.monotonic() + 15.0
        while True:
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            try:
                group.rmdir()
                break
            except OSError:  # EBUSY until the killed process is gone
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def inside(group: Path) -> list[str]:
    """`gemps server`'s command, started in `group` from its first instruction."""
    return ["sh", "-c", f'echo $$ > "{group / "cgroup.procs"}" && exec "$@"', "sh", *GEMPS_COMMAND]


def shared_memory(pid: int) -> int:
    """Bytes of shared memory the process `pid` maps (RssShmem: its clients' θ regions)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/PID/status")


def test_a_claim_is_not_taken_by_the_shared_memory_of_its_local_workers(tmp_path: Path) -> None:
    """Issue 77, item 7: what a claimant had taken of its claim was its resident memory's growth
    (VmRSS), which counts the θ regions its local workers share with it (RssShmem: the clients'
    memory, gone from the host's already). So once a job's workers on this host had registered, a
    second job admitted their shared memory again: with 16 workers (256 MiB of it), what the first
    may still take, the second's budget and its reserve came to 185 MiB more than one server alone
    admits in the host (a 2 GiB memory cgroup both servers run in). Now only anonymous memory
    (RssAnon) is taken, and they fit (70 MiB less: the second's own process)."""
    workers, registered = 20, 16
    options: dict[str, Any] = {
        "rule": "gem",
        "memory_claims_dir": str(tmp_path / "claims"),
        "max_workers": workers,
        "max_message_mb": 64,
    }
    with memory_cgroup(HOST_LIMIT) as group, contextlib.ExitStack() as stack:
        first = stack.enter_context(ServerProcess(command=inside(group), **options))
        for _ in range(registered):  # over the local socket, θ in shared memory (the SDK's default here)
            client = stack.enter_context(gemps.Client(first.target, timeout=60))
            client.register({"w": np.zeros(LOCAL_P, np.float32)})
            client.commit(np.full(LOCAL_P, 1e-3, np.float32))  # GEM's m_i written: taken for real
        assert shared_memory(first.pid) >= registered * 4 * LOCAL_P  # the regions this test is about
        alone = int(open_stub(first.target).Status(pb.StatusRequest(), timeout=30).memory_budget_bytes)
        assert workers * LOCAL_HELD + RESERVE < alone  # the first's claim is bounded by its workers
        second = stack.enter_context(ServerProcess(command=inside(group), **options))
        budget = settled(second, LOCAL_P)
    assert budget > 0 and workers * LOCAL_HELD + budget + RESERVE <= alone, (alone, budget)
