"""The Ray driver's bookkeeping of replicated partitions (gemps_worker.on_ray.partitions, the job's
checks), without a cluster: placement itself is tests/e2e/test_ray_replicas.py's."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as test_ray_faults.py: before ray
pytest.importorskip("ray")

from gemps_worker.on_ray import JobFailed, RayJob, RayJobOptions
from gemps_worker.on_ray import partitions as partitions_module
from gemps_worker.on_ray.addresses import layout, replica_set
from gemps_worker.on_ray.partitions import REPLICA_STRATEGY, STRATEGY, Partitions
from gemps_worker.on_ray.records import PartitionEndpoint


def endpoint(index: int, replica: int, port: int) -> PartitionEndpoint:
    return PartitionEndpoint(index, f"node-{index}-{replica}", "10.0.0.1", port, -1, 1, 1, "", replica)


def replicated(**options: Any) -> Partitions:
    return Partitions("job", RayJobOptions(partitions=2, replicas=2, etcd="http://e:2379", **options), {})


def test_slots_names_and_addresses_of_replicated_partitions() -> None:
    group = replicated()
    group.endpoints = [endpoint(i, r, 5000 + 10 * i + r) for i in range(2) for r in range(2)]
    assert list(group.slots(1)) == [2, 3]
    assert [e.replica for e in group.of(1)] == [0, 1]
    assert [group.actor_name(slot) for slot in (0, 3)] == ["partition 0 replica 0", "partition 1 replica 1"]
    assert [group.key(slot) for slot in (1, 2)] == ["p0r1", "p1r0"]
    assert group.target == "10.0.0.1:5000|10.0.0.1:5001"
    # The layout partition 0's replicas announce: itself "", partition 1 as its replica set.
    assert layout([group.address(i) for i in range(2)]) == ",10.0.0.1:5010|10.0.0.1:5011"
    assert replica_set(["a:1"]) == "a:1"


def test_unreplicated_partitions_keep_their_names() -> None:
    group = Partitions("job", RayJobOptions(partitions=2), {})
    assert [group.actor_name(slot) for slot in range(2)] == ["partition 0", "partition 1"]
    assert [group.key(slot) for slot in range(2)] == ["p0", "p1"]


def nodes(monkeypatch: pytest.MonkeyPatch, cpus: list[float]) -> None:
    alive = [{"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": cpu}} for i, cpu in enumerate(cpus)]
    monkeypatch.setattr(partitions_module, "alive_nodes", lambda: alive)


def test_replicas_are_strictly_spread_where_the_nodes_suffice(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes(monkeypatch, [0.0, 1.0, 1.0])  # a head without CPUs does not count
    assert replicated()._replica_strategy() == REPLICA_STRATEGY


def test_fewer_nodes_than_replicas_is_refused_unless_packing_is_allowed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nodes(monkeypatch, [0.0, 4.0])
    with pytest.raises(JobFailed, match=r"--replicas 2 .* and 1 node of the cluster has 1 CPU .* --pack-replicas"):
        replicated()._replica_strategy()
    with caplog.at_level(logging.WARNING, logger="gemps.ray"):
        assert replicated(pack_replicas=True)._replica_strategy() == STRATEGY
    assert "packing them (--pack-replicas)" in caplog.text


def test_a_replicated_job_needs_etcd_or_a_way_to_start_one() -> None:
    with pytest.raises(ValueError, match="replicas need etcd"):
        RayJob(RayJobOptions(replicas=2))
    assert RayJob(RayJobOptions(replicas=2), start_etcd=lambda host: pytest.fail("not before start")).etcd is None
    assert RayJob(RayJobOptions(replicas=2, etcd="http://e:2379")).etcd is None
