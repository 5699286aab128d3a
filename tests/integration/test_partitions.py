"""θ partitioned across several servers: the same commits give the same θ, bit for bit.

Every rule is elementwise, so partition i applying its slice of each commit in the same order
as one server would computes exactly that server's values for its range (DESIGN §3a).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from gemps_bench.procfs import partition_pids

from gemps import Client, InvalidArgumentError, PartiallyAppliedError, Reason, RetryPolicy
from gemps.records import CentralVariable
from gemps_proto.schema import partition_bounds
from gemps_server.domain.rules import rule_names
from gemps_worker.cluster import ServerProcess
from tests.helpers import CommitLoops, free_port, start_partitions, wait_for
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
    # adamw: a step every commit, so that one thread's commits in turn need not wait for a round
    rounds = {"round_size": 1} if rule == "adamw" else {}
    servers = start_partitions(targets_of, count, rule=rule, learning_rate=0.1, num_shards=0, **rounds)
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
    # Partition i listens on port + i and is restarted on it: ports from the suite's band, which the kernel
    # gives no other socket meanwhile (port 0's were ephemeral: a fresh clone's run found 44001 taken).
    options: dict[str, Any] = {"partitions": 2, "rule": "downpour", "checkpoint_dir": tmp_path, "checkpoint_every": 1}
    options["port"] = free_port()
    with ServerProcess(log_path=tmp_path / "server.log", **options) as server:
        retry = RetryPolicy(max_attempts=200, initial_backoff=0.05, max_backoff=0.5)
        clients = [Client(server.target, timeout=60.0, attempt_timeout=2.0, retry=retry) for _ in range(clients_count)]
        loops = CommitLoops(clients, {"w": np.zeros(size, np.float32)}, np.ones(size, np.float32), "update").start()
        loops.wait_each(20, 60, "commits before the kill")
        # Checkpoints are written beside the commits: under a loaded suite the first was once still a
        # temporary file at the kill, and the partition restarted from none (its workers re-seed it).
        kept = tmp_path / "partition-1"
        wait_for(lambda: any(kept.glob("checkpoint-*.safetensors")), 60, "partition 1's first checkpoint")
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
