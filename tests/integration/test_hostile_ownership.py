"""One server per address and per checkpoint directory (issue 28, item 1), against real processes.

gRPC sets SO_REUSEPORT by default: a second `gemps server` on a port already served started
beside the first, and the kernel split new connections between two different central variables.
The partitions of `gemps server --partitions K` outlived a SIGKILLed supervisor, and a new
supervisor on the same ports and checkpoint directory shared them with the orphans. Now a second
server on a taken port (gRPC, data plane or metrics) exits 2 at start with one line naming the
address; partitions die with their supervisor; a checkpoint directory belongs to one live server.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from gemps_bench.procfs import partition_pids

from gemps import Client
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess
from tests.helpers import free_port, server_outcome, wait_for
from tests.integration.conftest import SPEC, open_stub

pytestmark = pytest.mark.timeout(240)

PARAMS = {"w": np.zeros(1000, np.float32)}


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a dead child its new parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def dead(pid: int) -> bool:
    return not alive(pid)


def refused_in_one_line(code: int | None, lines: list[str], *expected: str) -> None:
    assert code is not None, "a second server started and served:\n" + "\n".join(lines)
    assert code == 2, lines
    assert len(lines) == 1, lines  # one clear line, no traceback, no gRPC core chatter
    for text in expected:
        assert text in lines[0], lines


def test_a_second_server_on_a_taken_grpc_port_exits_2_in_one_line(tmp_path: Path) -> None:
    with ServerProcess() as first:
        code, lines = server_outcome(tmp_path, "--port", str(first.port), "--data-port", "0", "--metrics-port", "-1")
        refused_in_one_line(code, lines, f"gRPC: cannot listen on 127.0.0.1:{first.port}", "in use")
        # Fresh connections all reach the first server's one central variable (its history token).
        open_stub(first.target).Register(
            pb.RegisterRequest(spec=SPEC, initial_parameters=tensor_to_proto(np.zeros(16, np.float32)))
        )
        histories = set()
        for _ in range(20):
            with grpc.insecure_channel(first.target) as channel:
                reply = pb_grpc.ParameterServerStub(channel).Pull(pb.PullRequest(known_version=-1), timeout=10)
                histories.add(reply.history)
        assert len(histories) == 1


@pytest.mark.parametrize("listener", ["data plane", "metrics"])
def test_a_second_server_on_a_taken_data_or_metrics_port_exits_2_in_one_line(tmp_path: Path, listener: str) -> None:
    data_port = free_port()
    with ServerProcess(data_port=data_port) as first:
        taken = data_port if listener == "data plane" else first.metrics_port
        flag = "--data-port" if listener == "data plane" else "--metrics-port"
        argv = ["--port", "0", "--data-port", "0", "--metrics-port", "0"]
        argv[argv.index(flag) + 1] = str(taken)
        code, lines = server_outcome(tmp_path, *argv)
        refused_in_one_line(code, lines, f"{listener}: cannot listen on 127.0.0.1:{taken}", "in use")


def test_a_killed_supervisors_partitions_die_with_it_and_a_new_one_recovers_its_directory(tmp_path: Path) -> None:
    """SIGKILL `gemps server --partitions 2`: its partitions shut down (gracefully: each writes
    its final checkpoint) instead of living on with the ports; a new supervisor on the same ports
    and directory then starts, recovers the dead one's lock and restores every acknowledged commit."""
    directory = tmp_path / "checkpoints"
    # The supervisor's port from the suite's band: partition 1's data port, bound to 0 by the second
    # supervisor, was once given partition 0's port (the first one's, ephemeral) before it bound it.
    options: dict[str, Any] = {"partitions": 2, "checkpoint_dir": directory, "checkpoint_every": 0, "port": free_port()}
    first = ServerProcess(log_path=tmp_path / "first.log", **options).start()
    children: dict[int, int] = {}
    try:
        with Client(first.target, timeout=10) as client:
            client.register(PARAMS)
            for _ in range(5):
                client.commit(np.ones(1000, np.float32))
        children = partition_pids(first.pid)
        assert sorted(children) == [0, 1]
        os.kill(first.pid, signal.SIGKILL)
        for index, pid in children.items():
            wait_for(functools.partial(dead, pid), 60, f"partition {index} (pid {pid}) to die with its supervisor")
    finally:
        first.kill()
        first.close()
        for pid in children.values():  # orphans of a failed run must not outlive the test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "first.log").read_text()
    assert log.count("checkpoint written") >= 2, log  # each partition's final checkpoint

    with ServerProcess(log_path=tmp_path / "second.log", **options) as second:  # the same port
        assert f"recovered the lock of pid {first.pid}, which is gone" in (tmp_path / "second.log").read_text()
        with Client(second.target, timeout=10) as observer:
            assert [status.version for status in observer.statuses()] == [5, 5]


def test_a_checkpoint_directory_belongs_to_one_live_server(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    with ServerProcess(partitions=2, checkpoint_dir=directory) as supervisor:
        partition0 = partition_pids(supervisor.pid)[0]
        common = ["--port", "0", "--data-port", "0", "--metrics-port", "-1"]
        for argv, holder in (
            (["--partitions", "2", "--checkpoint-dir", str(directory)], supervisor.pid),  # another supervisor
            (["--checkpoint-dir", str(directory)], supervisor.pid),  # a single server
            (["--checkpoint-dir", str(directory / "partition-0")], partition0),  # a partition's own folder
        ):
            code, lines = server_outcome(tmp_path, *common, *argv)
            assert code == 2, lines
            assert any(f"is in use by another gemps server (pid {holder}," in line for line in lines), lines
            assert not any("Traceback" in line for line in lines), lines


def test_a_partition_whose_supervisor_is_gone_does_not_start(tmp_path: Path) -> None:
    """The check behind the parent-death signal: a partition started for a supervisor that is not
    (or no longer) its parent exits at once instead of serving on its own."""
    common = ["--port", "0", "--data-port", "0", "--metrics-port", "-1"]
    not_its_parent = os.getppid()  # the server's parent is this process, not this process's parent
    code, lines = server_outcome(tmp_path, *common, "--supervisor-pid", str(not_its_parent))
    assert code == 2, lines
    assert any(f"supervisor {not_its_parent} is gone" in line for line in lines), lines
    code, lines = server_outcome(tmp_path, *common, "--supervisor-pid", str(os.getpid()))
    assert code is None, lines  # its real parent: it serves
