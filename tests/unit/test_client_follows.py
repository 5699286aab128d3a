"""A client follows a server process that moved (issue 34, item 2): against in-memory servers.

Partition 0 is found again through the client's resolver (gemps.resolver), another partition
through the layout partition 0 announces now. The moved process is "restored from a checkpoint"
by copying the old one's θ, version and receipts, as a restart on another machine would.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import gemps
from gemps import errors
from gemps.records import Layout
from gemps.resolver import PortFile, StaticAddress, as_resolver
from gemps.retry import RetryPolicy
from gemps.transport import CommitCall, Committed
from tests.unit.memory_transport import MemoryServer, connector, memory_cluster

P = 10
NO_WAIT = RetryPolicy(max_attempts=4, initial_backoff=0.0)
ONES = np.ones(P, np.float32)


def restore(moved: MemoryServer, old: MemoryServer) -> None:
    """`old`'s state in the new process `moved`: θ, version and receipts, but no workers."""
    assert old.theta is not None
    moved.theta, moved.version, moved.spec, moved.applied = old.theta.copy(), old.version, old.spec, dict(old.applied)
    moved.history = "restored"


def announcing(layout: Layout | None, index: int, partition: int, address: str) -> Layout:
    """`layout` as partition `index` announces it once `partition` is at `address`."""
    assert layout is not None
    partitions = list(layout.partitions)
    partitions[partition] = replace(partitions[partition], address=address)
    return Layout(index, tuple(partitions), layout.num_parameters)


def test_a_partition_that_moved_is_found_through_partition_0_and_nothing_applies_twice() -> None:
    servers = memory_cluster(P, 2)  # memory:7000 [0, 5), memory:7001 [5, 10)
    old = servers[1]
    moved = MemoryServer("memory:7002", old.learning_rate, announcing(old.layout, 1, 1, ":7002"))
    client = gemps.Client(servers[0].target, retry=NO_WAIT, connect=connector([*servers, moved]))
    client.register({"w": np.zeros(P, np.float32)})
    client.commit(ONES, kind="update")
    # Partition 1 applies the next commit, then its machine dies before the reply leaves: a process
    # restored from its state (that commit's receipt included) starts elsewhere on another port,
    # and partition 0 announces it.
    apply = old.commit

    def apply_then_die(call: CommitCall) -> Committed:
        apply(call)
        restore(moved, old)
        old.fail_next = 10**6
        servers[0].layout = announcing(servers[0].layout, 0, 1, ":7002")
        raise errors.ServerUnavailableError("UNAVAILABLE: connection reset")

    old.commit = apply_then_die  # type: ignore[method-assign]
    result = client.commit(ONES, kind="update")
    assert client.targets == ["memory:7000", "memory:7002"]
    np.testing.assert_array_equal(result.parameters.flat, np.full(P, 2.0, np.float32))  # each value moved twice
    assert moved.version == 2  # the retry was answered from the restored receipt, not applied again
    # Both attempts there (the old worker id, then registered again) carried the commit's request id.
    assert {call.request_id for call in moved.commits} == {old.commits[-1].request_id}
    client.commit(ONES, kind="update")  # and training goes on there
    assert (servers[0].version, moved.version) == (3, 3)


def test_partition_0_that_moved_is_found_through_the_resolver() -> None:
    [server] = memory_cluster(P, 1)
    moved = MemoryServer("memory:7100", server.learning_rate)
    where = [server.target]
    client = gemps.Client(lambda: where[0], retry=NO_WAIT, connect=connector([server, moved]))
    client.register({"w": np.zeros(P, np.float32)})
    client.commit(ONES, kind="update")
    server.fail_next = 10**6  # its machine is gone; the new process starts from its checkpoint
    restore(moved, server)
    where[0] = moved.target
    result = client.commit(ONES, kind="update")
    assert client.target == "memory:7100" and result.version == 2
    np.testing.assert_array_equal(result.parameters.flat, np.full(P, 2.0, np.float32))


def test_a_resolver_that_cannot_say_keeps_the_last_address() -> None:
    [server] = memory_cluster(P, 1)
    answers = iter([server.target])

    def resolve() -> str:
        return next(answers)  # then StopIteration: it does not know

    client = gemps.Client(resolve, retry=NO_WAIT, connect=connector([server]))
    client.register({"w": np.zeros(P, np.float32)})
    server.fail_next = 2  # two refused attempts, each followed by a look that finds nothing new
    assert client.commit(ONES, kind="update").version == 1
    assert client.target == server.target


def test_targets_become_resolvers(tmp_path: Path) -> None:
    assert as_resolver("h:1") == StaticAddress("h:1")
    assert as_resolver(lambda: "h:2").resolve() == "h:2"
    port_file = PortFile(tmp_path / "port", host="10.0.0.5")
    (tmp_path / "port").write_text("50051\n9090\n")
    assert as_resolver(port_file).resolve() == "10.0.0.5:50051"
    with pytest.raises(TypeError):
        as_resolver(42)  # type: ignore[arg-type]
