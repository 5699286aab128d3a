"""A multi-node Ray cluster on this one machine, for tests, measurements and trying `gemps ray`.

`ray.cluster_utils.Cluster` starts a head and more raylets, each a node with its own resources,
so placement across nodes is Ray's real scheduling. Every node is on 127.0.0.1; Ray gives actors
that address (and the partitions listen on it) only when `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
was set before ray was first imported: set it first thing in the program.

`RemoveNode` removes a node mid-run as a machine dies (no drain, every process on it killed at
once), for the fault tests and figures.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray._private.ray_constants import PROCESS_TYPE_RAYLET
from ray.cluster_utils import Cluster

from gemps_worker.on_ray.faults import worker_name
from gemps_worker.on_ray.job import RayJob
from gemps_worker.on_ray.records import StatusSample, TimedEvaluation

log = logging.getLogger("gemps.ray")

LOOPBACK = "127.0.0.1"
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is loopback


@contextlib.contextmanager
def local_cluster(
    nodes: int, cpus_per_node: float, *, head_cpus: float | None = None, loss_noticed_in: float | None = None
) -> Iterator[Cluster]:
    """`nodes` Ray nodes of `cpus_per_node` (logical) CPUs here, this process connected to them.
    `head_cpus`: the head's instead (0, as Ray advises for real clusters, keeps actors off the
    head, so that a test may lose any node that holds them: losing the head ends the cluster).
    `loss_noticed_in`: seconds of failed health checks after which Ray marks a node dead, for tests
    of what follows (Ray's defaults take 13-22 s here: scripts/ray_nodes.py measures with those)."""
    if os.environ.get(LOOPBACK_SWITCH) != "0":
        raise RuntimeError(f"set {LOOPBACK_SWITCH}=0 before importing ray: the nodes listen on {LOOPBACK} only")
    node: dict[str, Any] = {"num_cpus": cpus_per_node, "node_ip_address": LOOPBACK}
    head = {**node, "include_dashboard": False} | ({} if head_cpus is None else {"num_cpus": head_cpus})
    if loss_noticed_in is not None:
        # A check a second; a lost raylet refuses each at once, a slow one (a loaded machine) has 3 s.
        checks = max(1, math.ceil(loss_noticed_in))
        head["_system_config"] = {
            "health_check_period_ms": 1000,
            "health_check_timeout_ms": 3000,
            "health_check_failure_threshold": checks,
        }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from Linux's /proc: a raylet's workers and what they started."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found: list[int] = []
    below = children.get(pid, [])
    while below:
        found.extend(below)
        below = [child for process in below for child in children.get(process, [])]
    return found


def kill_node(cluster: Cluster, node: Any, *, machine: bool = True) -> list[int]:
    """Remove `node` as a machine dies. Ray's own removal kills the raylet only, and its workers
    (a partition's actor and its server process) would go on serving for seconds more, until
    they noticed: here they end with it.

    `machine=False`: the raylet alone is SIGKILLed, as when it crashes, and left unreaped (this
    process, its parent, does not wait for it): Ray's workers ask whether its pid exists and never
    notice; the node's other processes live on. `cluster.remove_node(node)` afterwards ends them
    (issue 42, item 7). Returns the pids SIGKILLed (a test that finds a life of the node still
    running can say whether it was among them)."""
    raylets = [info.process for info in node.all_processes.get(PROCESS_TYPE_RAYLET, [])]
    if not machine:
        for raylet in raylets:
            os.kill(raylet.pid, signal.SIGKILL)
        return [raylet.pid for raylet in raylets]
    processes = [pid for raylet in raylets for pid in descendants(raylet.pid)]
    cluster.remove_node(node, allow_graceful=False)
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return processes


class RemoveNode:
    """A progress callback for `RayJob.wait`: once partition 0's version reaches `version`, a node
    dies as a machine does (`remove_node(allow_graceful=False)`): partition `partition`'s (of a
    replicated one: its primary's, as the driver last sampled it), or (None) the one holding the
    most workers and no partition, never the head. Waits for a later sample while the driver has
    not yet seen where every worker runs (or who is the partition's primary). `machine`: as
    kill_node's (False: the raylet alone dies)."""

    def __init__(
        self, cluster: Cluster, job: RayJob, version: int, partition: int | None = None, *, machine: bool = True
    ) -> None:
        self.cluster, self.job, self.version, self.partition = cluster, job, version, partition
        self.machine = machine
        self.held_partitions: list[str] = []  # the job's partition actors on it (replicas: "partition 1 replica 0")
        self.primaries: list[int] = []  # the partitions whose primary (as last sampled) ran on it
        self.node_id = ""
        self.node: Any = None  # Ray's, once removed
        self.removed = 0.0  # unix time
        self.workers: list[int] = []  # those it held that were still training
        self.finished: list[int] = []  # those it held whose training had ended (their outcome stands)
        self.killed: list[int] = []  # the pids its removal SIGKILLed

    def __call__(self, sample: StatusSample, evaluation: TimedEvaluation | None) -> None:
        if self.removed or sample.version < self.version:
            return
        places = self.job.faults.places
        workers = [worker_name(index) for index in range(len(self.job.worker_actors))]
        if not all(worker in places for worker in workers):
            return
        primaries = self.job.primary_nodes()
        if self.partition is not None and not primaries[self.partition]:
            return
        head = self.cluster.head_node
        partitions = self.job.partition_nodes()
        spared = {*partitions, "" if head is None else head.node_id}
        nodes = {node.node_id: node for node in self.cluster.worker_nodes}
        held = {node: [i for i, w in enumerate(workers) if places[w].node_id == node] for node in nodes}
        if self.partition is not None:
            self.node_id = primaries[self.partition]
        elif any(held[node] for node in nodes if node not in spared):
            self.node_id = max((node for node in nodes if node not in spared), key=lambda node: len(held[node]))
        else:
            raise RuntimeError(f"no node holds workers and no partition: {places}")
        # Under load the removal waits for the driver's looks, and a worker started early may have
        # spent its whole budget by then (twice in full runs): it has nothing left to lose.
        training = self.job.workers.still_training()
        self.workers = [index for index in held[self.node_id] if index in training]
        self.finished = [index for index in held[self.node_id] if index not in training]
        self.held_partitions = [actor for actor in self.job.faults.held(self.node_id) if actor.startswith("partition")]
        self.primaries = [index for index, node in enumerate(primaries) if node == self.node_id]
        log.warning(
            "removing Ray node %s (workers %s; finished before: %s) at version %d",
            self.node_id[:12], self.workers, self.finished, sample.version,
        )  # fmt: skip
        self.removed = time.time()
        self.node = nodes[self.node_id]
        self.killed = kill_node(self.cluster, self.node, machine=self.machine)


def resumed_after(samples: list[StatusSample], removed: float) -> float | None:
    """Seconds from a node's loss (unix time `removed`) to partition 0's first version past the
    one it stood at a second later, when the workers wait for what the node held (None: it never
    moved again). Sampled every `--interval`, so late by up to that."""
    later = [sample for sample in samples if sample.time >= removed + 1.0]
    moved = [sample.time for sample in later if sample.version > later[0].version] if later else []
    return moved[0] - removed if moved else None
