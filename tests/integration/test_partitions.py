"""θ partitioned across several servers: the same commits give the same θ, bit for bit.

Every rule is elementwise, so partition i applying its slice of each commit in the same order
as one server would computes exactly that server's values for its range (DESIGN §3a).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from gemps_bench.procfs import partition_pids

from gemps import Client, InvalidArgumentError, PartiallyAppliedError, Reason, RetryPolicy
from gemps.records import CentralVariable
from gemps_proto.schema import partition_bounds
from gemps_server.checkpoint_files import list_checkpoints
from gemps_server.domain.rules import rule_names
from gemps_worker.cluster import ServerProcess
from tests.helpers import CommitLoops, scrape_series, start_partitions, wait_for
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")  # over shared memory, the data plane over TCP, and gRPC

# 10,007 values (prime): no partition count here divides it evenly.
MODEL = {"conv": (7, 11, 13), "fc": (1000, 9), "bias": (6,)}
BUFFERS = {"running_mean": (5,)}
WORKERS = 3
COMMITS = 24


def initial(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in MODEL.items()}


def train(targets_of: StartServer, count: int, rule: str) -> tuple[CentralVariable, list[int]]:
    """A fixed sequence of commits from several workers, one at a time, on `count` partitions;
    returns the final central variable (read by an observer) and the staleness of each commit."""
    servers = start_partitions(targets_of, count, rule=rule, learning_rate=0.1, num_shards=0)
    target = servers[0].target
    rng = np.random.default_rng(7)
    clients = [Client(target, name=f"w{i}", timeout=10) for i in range(WORKERS)]
    staleness = []
    try:
        buffers = {name: np.zeros(shape, np.float32) for name, shape in BUFFERS.items()}
        for index, client in enumerate(clients):
            client.register(initial(index), buffers)  # worker 0's values initialise θ
        for step in range(COMMITS):
            client = clients[(step * 5) % WORKERS]  # an order that leaves workers behind
            payload = rng.standard_normal(sum(np.prod(s) for s in MODEL.values())).astype(np.float32)
            kind = "update" if step % 4 == 3 else "gradient"
            delta = {"running_mean": rng.standard_normal(5).astype(np.float32)}
            result = client.commit(payload * 0.01, kind=kind, loss=1.0, buffer_delta=delta)
            staleness.append(result.staleness)
            if step == COMMITS // 2:  # a worker leaves and another joins: fresh per-worker state
                clients[1].leave()
                clients[1].register(initial(1), buffers)
        with Client(target, timeout=10) as observer:
            return observer.pull(), staleness
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("rule", rule_names())
def test_partitions_give_bit_identical_theta_for_every_rule(start_server: StartServer, rule: str) -> None:
    single, single_staleness = train(start_server, 1, rule)
    assert single.version == COMMITS and max(single_staleness) > 0  # stale commits were in the sequence
    for count in (2, 3):
        split, staleness = train(start_server, count, rule)
        assert split.versions == (COMMITS,) * count
        assert staleness == single_staleness
        np.testing.assert_array_equal(split.flat, single.flat)  # bit-identical, not merely close
        np.testing.assert_array_equal(split.buffers, single.buffers)
        assert not np.array_equal(single.flat, np.concatenate([v.reshape(-1) for v in initial(0).values()]))


def test_the_first_partition_announces_the_layout(start_server: StartServer) -> None:
    servers = start_partitions(start_server, 3)
    with Client(servers[0].target, timeout=10) as client:
        client.register(initial(0))
        assert client.targets == [server.target for server in servers]
        layout = client.layout
        assert layout is not None and layout.num_parameters == 10_007
        assert [(p.start, p.stop) for p in layout.partitions] == partition_bounds(10_007, 3)
        assert [p.stop - p.start for p in layout.partitions] == [3336, 3336, 3335]
        statuses = client.statuses()
        assert [s.num_parameters for s in statuses] == [3336, 3336, 3335]
        assert [s.active_workers for s in statuses] == [1, 1, 1]
        assert [s.layout.index for s in statuses if s.layout is not None] == [0, 1, 2]
    for server in servers:  # the worker left every partition
        assert len(server.server.state.registry) == 0


def test_one_partition_is_todays_wire(start_server: StartServer) -> None:
    """K = 1 announces no layout: replies are byte for byte what they were before partitions."""
    server = start_server()
    with Client(server.target, timeout=10) as client:
        registration = client.register(initial(0))
        assert registration.layout is None and client.layout is None and client.status().layout is None
        assert client.central is not None and client.central.versions == (0,)


def test_a_model_smaller_than_the_partition_count_is_refused(start_server: StartServer) -> None:
    from gemps.errors import InvalidArgumentError

    servers = start_partitions(start_server, 3)
    with Client(servers[0].target, timeout=10) as client, pytest.raises(InvalidArgumentError, match="fewer than"):
        client.register({"w": np.zeros(2, np.float32)})


def test_a_killed_partition_restarts_from_its_checkpoint_and_training_carries_on(tmp_path: Path) -> None:
    """SIGKILL one partition mid-training: its supervisor starts it again from its checkpoint;
    workers block on it, retry and carry on; the other partition keeps its state; no commit is
    applied twice. Update commits of ones under downpour make each range's θ count its commits."""
    size, clients_count = 5001, 3
    options: dict[str, Any] = {"partitions": 2, "rule": "downpour", "checkpoint_dir": tmp_path, "checkpoint_every": 1}
    with ServerProcess(log_path=tmp_path / "server.log", **options) as server:
        retry = RetryPolicy(max_attempts=200, initial_backoff=0.05, max_backoff=0.5)
        clients = [Client(server.target, timeout=60.0, attempt_timeout=2.0, retry=retry) for _ in range(clients_count)]
        loops = CommitLoops(clients, {"w": np.zeros(size, np.float32)}, np.ones(size, np.float32), "update").start()
        loops.wait_each(20, 60, "commits before the kill")
        victim = partition_pids(server.pid)[1]
        acked_before_kill = sum(loops.acked)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: partition_pids(server.pid).get(1, victim) != victim, 60, "partition 1 started again")
        loops.wait_each(20, 90, "carrying on")
        loops.stop()
        assert not loops.failures, loops.failures
        with Client(server.target, timeout=10) as observer:
            statuses = observer.statuses()
            theta = observer.pull().flat
        for client in clients:
            client.close()
        log = (tmp_path / "server.log").read_text()
    total = sum(loops.acked)
    first, second = statuses
    assert first.commits_applied == total  # the partition left alone applied each commit exactly once
    restored = re.search(r"partition 1\]: checkpoint restored path=\S+ version=(\d+)", log)
    assert restored is not None, log
    # Partition 1 lost what it applied after its newest checkpoint (SIGKILL: no final one), and
    # never applies more than was acknowledged: the retries of commits in flight at the kill that
    # it had checkpointed were answered from its ledger. After the restart it applied every commit
    # acknowledged since, give or take the ones in flight at the kill (one per client).
    restored_version = int(restored.group(1))
    assert second.commits_applied <= total
    applied_after = second.commits_applied - restored_version
    assert abs(applied_after - (total - acked_before_kill)) <= clients_count
    assert "partition 1 exited with status -9; starting it again" in log
    boundary = partition_bounds(size, 2)[0][1]
    np.testing.assert_array_equal(theta[:boundary], np.full(boundary, total, np.float32))
    np.testing.assert_array_equal(theta[boundary:], np.full(size - boundary, second.commits_applied, np.float32))


def test_a_commit_refused_by_one_partition_says_which_applied_it_and_theta_follows(start_server: StartServer) -> None:
    """Issue 28: an update that partition 0 applies and partition 1 refuses (its range would leave
    float32) is a PartiallyAppliedError naming both, and the client's θ holds partition 0's reply."""
    servers = start_partitions(start_server, 2, rule="downpour")
    size = 1001
    boundary = partition_bounds(size, 2)[0][1]
    values = np.zeros(size, np.float32)
    values[boundary:] = 3e38  # partition 1's range near float32's top
    with Client(servers[0].target, timeout=10) as client:
        client.register({"w": values})
        with pytest.raises(PartiallyAppliedError) as partial:
            client.commit(np.full(size, 3e38, np.float32), kind="update")  # finite, but 3e38 + 3e38 is not
        error = partial.value
        assert (error.applied, error.refused) == ((0,), (1,))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.reason == Reason.NON_FINITE
        assert error.message.startswith("commit applied by partition 0 of 2 and refused by partition 1: ")
        assert isinstance(error, InvalidArgumentError) and isinstance(error.__cause__, InvalidArgumentError)
        central = client.central
        assert central is error.central and central.versions == (1, 0)
        np.testing.assert_array_equal(central.flat, np.full(size, 3e38, np.float32))  # partition 0 moved
        observed = client.pull()
        assert observed.versions == (1, 0)
        np.testing.assert_array_equal(observed.flat, central.flat)


def test_a_payload_or_buffer_delta_with_nan_reaches_no_partition(start_server: StartServer) -> None:
    """Issue 28: the SDK checks finiteness before sending, so no partition applies a commit that
    another would refuse for a NaN in its own range (the buffers' delta goes to partition 0 only)."""
    servers = start_partitions(start_server, 2)
    with Client(servers[0].target, timeout=10) as client:
        client.register(initial(0), {"running_mean": np.zeros(5, np.float32)})
        in_partition_1 = np.ones(10_007, np.float32)
        in_partition_1[-1] = np.nan
        bad_delta = np.array([0, 0, np.inf, 0, 0], np.float32)
        for payload, delta, what in (
            (in_partition_1, None, "payload"),
            (np.ones(10_007, np.float32), bad_delta, "buffer_delta"),
        ):
            with pytest.raises(InvalidArgumentError, match=f"{what} contains NaN or Inf: not sent") as refused:
                client.commit(payload, buffer_delta=delta)
            assert refused.value.reason == Reason.NON_FINITE
        statuses = client.statuses()
        assert [(s.version, s.commits_rejected) for s in statuses] == [(0, 0), (0, 0)]


def gemps_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gemps_cli", *argv], capture_output=True, text=True, timeout=120)


def test_status_and_export_assemble_every_partition(tmp_path: Path) -> None:
    """`gemps server --partitions 3`: `gemps status` lists each partition, `gemps export` writes
    the whole θ, live and from the per-partition checkpoint directories, and a restart of the
    whole server restores each partition from its own."""
    options: dict[str, Any] = {"partitions": 3, "checkpoint_dir": tmp_path / "ckpt", "checkpoint_every": 1}
    with ServerProcess(**options) as server, Client(server.target, timeout=10) as client:
        client.register(initial(0), {"running_mean": np.arange(5, dtype=np.float32)})
        trained = client.commit(np.ones(10_007, np.float32)).parameters
        status = gemps_command("status", "--server", server.target)
        assert status.returncode == 0, status.stderr
        assert "parameters      10007 in 3 tensors" in status.stdout
        assert "partitions      3" in status.stdout
        assert "noise scale     no estimate (no gradient commits measured yet" in status.stdout  # 1 commit of 2
        for index, (start, stop) in enumerate(partition_bounds(10_007, 3)):
            assert re.search(
                rf"  {index}  127\.0\.0\.1:\d+ +values {start}\.\.{stop - 1}  version 1  workers 1", status.stdout
            )
        # One Prometheus target for the three: each partition's series under its label.
        series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        for index in range(3):
            assert series[f'gemps_partition_up{{partition="{index}"}}'] == 1
            assert series[f'gemps_central_version{{partition="{index}"}}'] == 1
            assert series[f'gemps_parameters{{partition="{index}"}}'] == np.diff(partition_bounds(10_007, 3)[index])[0]
        wait_for(lambda: all(list_checkpoints(tmp_path / "ckpt" / f"partition-{i}") for i in range(3)), 30)
        for source in (["--server", server.target], [str(tmp_path / "ckpt")]):
            out = tmp_path / "model.safetensors"
            result = gemps_command("export", *source, "--out", str(out))
            assert result.returncode == 0, result.stderr
            assert "version 1, 4 tensors, 10007 parameters, 5 buffer values" in result.stdout
            exported = safetensors.numpy.load_file(str(out))
            for name, value in trained.state_dict().items():
                np.testing.assert_array_equal(exported[name], value)
    with ServerProcess(**options) as server, Client(server.target, timeout=10) as observer:
        restored = observer.pull()
        assert restored.versions == (1, 1, 1)
        np.testing.assert_array_equal(restored.flat, trained.flat)
        np.testing.assert_array_equal(restored.buffers, trained.buffers)
    one = gemps_command("export", str(tmp_path / "ckpt" / "partition-1"), "--out", str(tmp_path / "x"))
    assert one.returncode == 1 and "partition 1 of 3" in one.stderr


def written(directory: Path, version: int) -> bool:
    """Both partitions' newest checkpoints are at `version`."""
    return all((found := list_checkpoints(directory / f"partition-{i}")) and found[-1][0] == version for i in range(2))


def test_export_refuses_partitions_at_different_versions_unless_asked(tmp_path: Path) -> None:
    """Issue 28: partition 1 restarted from an older checkpoint than partition 0's (as after a
    SIGKILL) holds θ's range at another version. `gemps export` names every partition's version and
    refuses the mix, from the checkpoints and from the live server, unless --allow-mixed-versions."""
    options: dict[str, Any] = {"partitions": 2, "checkpoint_dir": tmp_path / "ckpt", "checkpoint_every": 1}
    with ServerProcess(**options) as server, Client(server.target, timeout=10) as client:
        client.register(initial(0))
        for version in range(1, 4):
            client.commit(np.ones(10_007, np.float32))
            # each version on disk before the next commit: a busy writer would otherwise skip to the newest
            wait_for(functools.partial(written, tmp_path / "ckpt", version), 30, f"checkpoints at version {version}")
    newest = list_checkpoints(tmp_path / "ckpt" / "partition-1")[-1]
    assert newest[0] == 3
    newest[1].unlink()  # partition 1's newest is now an older one's
    older = list_checkpoints(tmp_path / "ckpt" / "partition-1")[-1][0]
    assert older < 3
    out = tmp_path / "model.safetensors"
    refused = gemps_command("export", str(tmp_path / "ckpt"), "--out", str(out))
    assert refused.returncode == 1, refused.stdout
    assert f"partition versions: 0: 3, 1: {older}" in refused.stdout
    assert f"partition 0 at 3, partition 1 at {older}" in refused.stderr and "--allow-mixed-versions" in refused.stderr
    assert not out.exists()
    allowed = gemps_command("export", str(tmp_path / "ckpt"), "--out", str(out), "--allow-mixed-versions")
    assert allowed.returncode == 0, allowed.stderr
    assert f"partition versions: 0: 3, 1: {older}" in allowed.stdout
    assert "different versions, as asked" in allowed.stdout
    assert safetensors.safe_open(str(out), "numpy").metadata()["partition_versions"] == f"3,{older}"
    with ServerProcess(**options) as server:  # restored from those: the live server holds the mix too
        live = gemps_command("export", "--server", server.target, "--out", str(tmp_path / "live.safetensors"))
        assert live.returncode == 1 and f"partition 0 at 3, partition 1 at {older}" in live.stderr


def test_a_partitions_checkpoint_is_refused_by_a_server_of_another_layout(tmp_path: Path) -> None:
    """A partition's checkpoint holds its range only: started as another partition, or as a whole
    server, the process refuses to start (exit 2) rather than serve a wrong θ."""
    with ServerProcess(partitions=2, checkpoint_dir=tmp_path) as server, Client(server.target, timeout=10) as client:
        client.register(initial(0))
    layouts: list[dict[str, Any]] = [{}, {"partitions": 2, "partition_index": 0, "partition_addresses": ",:1"}]
    for options in layouts:
        wrong = ServerProcess(checkpoint_dir=tmp_path / "partition-1", **options)
        with pytest.raises(RuntimeError, match="exited with 2"):
            wrong.start()
        assert "the checkpoint holds partition 1 of 2; this server serves partition 0 of" in wrong.log()
