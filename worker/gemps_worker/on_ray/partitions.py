"""The partitions of a Ray job, from the driver's side: placed, started in the order the layout
needs, followed when Ray restarts one (on another node when its node was lost), and stopped.

- One placement group of K bundles, SPREAD: Ray puts the bundles on distinct nodes while they
  have room, and when a node holding one is lost, places that bundle again on a surviving node
  with room, even one that holds another partition. STRICT_SPREAD would leave it unplaced (and
  the job waiting) whenever fewer nodes than partitions remain.
- Partitions 1..K-1 start first; partition 0 starts last, told their HOST:PORT, so a worker that
  can register gets the whole layout (as `gemps server --partitions K` does on one machine).
- When the driver sees a partition's new endpoint (a restart, on fresh ports when it moved), it
  tells partition 0's actor, which announces the new layout (gemps_worker.on_ray.addresses).

With --replicas R (DESIGN §3d) each partition is R actors, one `gemps server --replica-index r`
each, and a placement group of its own: R bundles, STRICT_SPREAD, so that no node holds two
replicas of a partition (the point of a replica is to outlive its node). Here an unplaced
bundle is what we want: a lost replica waits for a node that holds no other replica of its
partition, while the survivor, promoted by etcd, serves. A cluster with fewer nodes than R is
refused unless --pack-replicas (then SPREAD, with a warning). Every replica of partition 0
announces the layout, in which a partition's address is its replicas' ("A|B").
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gemps.resolver import Resolver
from gemps_worker.on_ray.actors import PartitionServer
from gemps_worker.on_ray.addresses import PartitionZero, PartitionZeroReplicas, layout, replica_set
from gemps_worker.on_ray.calls import Looks, alive_nodes, answers, get_within
from gemps_worker.on_ray.faults import FaultLog, JobFailed, partition_name, replica_name
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.records import ActorPlace, PartitionEndpoint

log = logging.getLogger("gemps.ray")

STRATEGY = "SPREAD"
REPLICA_STRATEGY = "STRICT_SPREAD"


class Partitions:
    """Partition i's replica r: `actors[slot]` and `endpoints[slot]` (as last seen), slot i * R + r
    (R = 1: slot i); in bundle i of the one placement group, or bundle r of placement group i."""

    def __init__(self, name: str, options: RayJobOptions, server_options: Mapping[str, object]) -> None:
        self.name, self.options, self.server_options = name, options, server_options
        self.replicas = options.replicas
        self.etcd = ""  # with replicas: set by the job before start()
        self.etcd_pems: dict[str, str] = {}  # the client credentials of the driver's etcd (none: an open one)
        # What this job's replicas prove themselves to each other with: drawn here, handed to each
        # actor (Ray's object store, never a command line), which keeps it in a 0600 file.
        self._replication_secret = secrets.token_hex(32)
        self.placements: list[PlacementGroup] = []
        self.actors: list[Any] = []
        self.endpoints: list[PartitionEndpoint] = []
        self._told: tuple[object, str] = ((), "")  # partition 0's lives (node, pid) and the layout they announce

    # -- slots ---------------------------------------------------------------------------------

    def slots(self, index: int) -> range:
        return range(index * self.replicas, (index + 1) * self.replicas)

    def of(self, index: int) -> list[PartitionEndpoint]:
        """Partition `index`'s replicas (R = 1: itself), as last seen."""
        return [self.endpoints[slot] for slot in self.slots(index)]

    def actor_name(self, slot: int) -> str:
        """What the fault log and the job's summary call it: "partition 1", "partition 1 replica 0"."""
        index, replica = divmod(slot, self.replicas)
        return partition_name(index) if self.replicas == 1 else replica_name(index, replica)

    def key(self, slot: int) -> str:
        index, replica = divmod(slot, self.replicas)
        return f"p{index}" if self.replicas == 1 else f"p{index}r{replica}"

    def address(self, index: int) -> str:
        """Partition `index`'s address for workers and the layout: HOST:PORT, or its replicas' A|B."""
        return replica_set([endpoint.target for endpoint in self.of(index)])

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        count, cpus = self.options.partitions, self.options.partition_cpus
        if self.replicas == 1:
            groups = [placement_group([{"CPU": cpus}] * count, strategy=STRATEGY, name=f"{self.name}-partitions")]
            strategy = STRATEGY
        else:
            strategy = self._replica_strategy()
            groups = [
                placement_group([{"CPU": cpus}] * self.replicas, strategy=strategy, name=f"{self.name}-partition-{i}")
                for i in range(count)
            ]
        self.placements = groups
        timeout = self.options.startup_timeout
        ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=timeout)
        if len(ready) < len(groups):
            fitting = [node for node in alive_nodes() if node["Resources"].get("CPU", 0.0) >= cpus]
            bundles = f"{count} partitions" if self.replicas == 1 else f"{count} partitions x {self.replicas} replicas"
            raise JobFailed(
                f"Ray could not place {bundles} of {cpus} CPU ({strategy}) within "
                f"{timeout:g}s: {len(fitting)} nodes have that much CPU"
            )
        others = [self._actor(slot) for slot in range(self.replicas, count * self.replicas)]
        self.actors = others
        endpoints = get_within([actor.endpoint.remote() for actor in others], timeout)
        targets = [endpoint.target for endpoint in endpoints]  # partitions 1..K-1, R replicas each
        per = self.replicas
        addresses = layout(["", *(replica_set(targets[i * per : (i + 1) * per]) for i in range(count - 1))])
        first = [self._actor(slot, addresses) for slot in range(self.replicas)]
        self.actors = [*first, *others]
        self.endpoints = [*get_within([actor.endpoint.remote() for actor in first], timeout), *endpoints]
        self._told = (self._lives(), addresses)

    def _replica_strategy(self) -> str:
        """STRICT_SPREAD when there are nodes enough for a partition's replicas, else (with
        --pack-replicas) SPREAD; else JobFailed, saying what to do."""
        cpus = self.options.partition_cpus
        fitting = [node for node in alive_nodes() if node["Resources"].get("CPU", 0.0) >= cpus]
        if len(fitting) >= self.replicas:
            return REPLICA_STRATEGY
        what = (
            f"--replicas {self.replicas} places each partition's replicas on distinct nodes, and {len(fitting)} "
            f"node{'' if len(fitting) == 1 else 's'} of the cluster ha{'s' if len(fitting) == 1 else 've'} "
            f"{cpus:g} CPU for one"
        )
        if not self.options.pack_replicas:
            raise JobFailed(
                f"{what}: add nodes, lower --replicas, or give --pack-replicas true to run them on the nodes there "
                "are (they then outlive a process's death, not a node's)"
            )
        log.warning("%s: packing them (--pack-replicas): a node's loss may take a partition's every replica", what)
        return STRATEGY

    def _actor(self, slot: int, addresses: str = "") -> Any:
        index, replica = divmod(slot, self.replicas)
        if self.replicas == 1:
            group, bundle = self.placements[0], index
            replication: dict[str, object] | None = None
        else:
            group, bundle = self.placements[index], replica
            replication = {
                "replicas": self.replicas, "replica_index": replica, "etcd": self.etcd, "job": self.name,
                "replication_secret": self._replication_secret,
            }  # fmt: skip
        actor_class = ray.remote(PartitionServer).options(
            num_cpus=self.options.partition_cpus,
            max_restarts=self.options.partition_restarts,
            # As the workers': a lost node first shows as an actor that does not answer, and a
            # call waits for its restart (bounded by max_restarts) instead of failing meanwhile.
            max_task_retries=-1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
        )
        return actor_class.remote(
            index,
            self.options.partitions,
            job=self.name,
            work_dir=self.options.work_dir,
            host=self.options.host,
            server_options=self.server_options,
            addresses=addresses,
            startup_timeout=self.options.startup_timeout,
            replication=replication,
            etcd_pems=self.etcd_pems if replication else None,
        )

    # -- follow --------------------------------------------------------------------------------

    @property
    def target(self) -> str:
        """Partition 0's address as last seen (its replicas': "A|B")."""
        return self.address(0)

    def resolver(self) -> Resolver:
        """Where partition 0 is now, for the workers and the evaluator."""
        if self.replicas == 1:
            return PartitionZero(self.actors[0])
        return PartitionZeroReplicas(self.actors[: self.replicas], [endpoint.target for endpoint in self.of(0)])

    def _lives(self) -> tuple[tuple[str, int], ...]:
        return tuple((endpoint.node_id, endpoint.pid) for endpoint in self.of(0))

    def look(self, looks: Looks, faults: FaultLog) -> None:
        """Ask each actor where it serves, without waiting: a new life is noted (a restart), and
        when one serves elsewhere than partition 0 announces, partition 0 is told (each replica
        of it, which announces from its own file)."""
        for slot, actor in enumerate(self.actors):
            self.endpoints[slot] = looks.look(self.key(slot), actor.endpoint.remote) or self.endpoints[slot]
        for slot, endpoint in enumerate(self.endpoints):
            place = ActorPlace(endpoint.node_id, endpoint.host, endpoint.metrics_port, endpoint.pid)
            faults.seen(self.actor_name(slot), place)
        told = (self._lives(), layout([self.address(index) for index in range(self.options.partitions)]))
        if self.options.partitions > 1 and told != self._told:
            log.info("partition 0 (lives %s) told the layout %s", told[0], told[1])
            for actor in self.actors[: self.replicas]:
                actor.announce.remote(told[1])  # waits for its restart when it is down itself
            self._told = told

    def failed_for_good(self, looks: Looks) -> list[tuple[str, ray.exceptions.RayError]]:
        """Partitions whose actors Ray will not restart again (their restarts spent, or a restart
        that refused to start), by the name of the last one: their calls fail for good, unlike the
        unanswered ones of a restart. A replicated partition fails when all its replicas did."""
        failed: list[tuple[str, ray.exceptions.RayError]] = []
        for index in range(self.options.partitions):
            errors = [(self.actor_name(slot), looks.error(self.key(slot))) for slot in self.slots(index)]
            dead = [(name, error) for name, error in errors if isinstance(error, ray.exceptions.ActorDiedError)]
            if len(dead) == len(errors):
                failed.append(dead[-1])
        return failed

    def standing(self, faults: FaultLog) -> dict[int, Any]:
        """The actors (by slot) not last seen on a lost node."""
        return {slot: actor for slot, actor in enumerate(self.actors) if not faults.gone(self.actor_name(slot))}

    def stop(self, faults: FaultLog, timeout: float) -> None:
        """Each partition shuts down gracefully (its final checkpoint). One last seen on a lost node
        is not asked: it has no server to stop, and its actor may still wait for a node."""
        standing = self.standing(faults)
        if standing:
            codes = answers([actor.stop.remote() for actor in standing.values()], timeout)
            for slot, code in zip(standing, codes, strict=True):
                if code != 0:
                    log.warning("%s stopped with status %s", self.actor_name(slot), code)

    def release(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        for group in self.placements:
            remove_placement_group(group)
        self.placements = []
