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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gemps_worker.on_ray.actors import PartitionServer
from gemps_worker.on_ray.addresses import PartitionZero, layout
from gemps_worker.on_ray.calls import Looks, alive_nodes, answers, get_within
from gemps_worker.on_ray.faults import FaultLog, JobFailed, partition_name
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.records import ActorPlace, PartitionEndpoint

log = logging.getLogger("gemps.ray")

STRATEGY = "SPREAD"


class Partitions:
    """Partition i: `actors[i]`, in bundle i of `placement`, serving at `endpoints[i]` as last seen."""

    def __init__(self, name: str, options: RayJobOptions, server_options: Mapping[str, object]) -> None:
        self.name, self.options, self.server_options = name, options, server_options
        self.placement: PlacementGroup | None = None
        self.actors: list[Any] = []
        self.endpoints: list[PartitionEndpoint] = []
        self._told: tuple[str, int, str] = ("", 0, "")  # partition 0's life (node, pid) and the layout it announces

    def start(self) -> None:
        count, cpus = self.options.partitions, self.options.partition_cpus
        self.placement = placement_group([{"CPU": cpus}] * count, strategy=STRATEGY, name=f"{self.name}-partitions")
        ready, _ = ray.wait([self.placement.ready()], timeout=self.options.startup_timeout)
        if not ready:
            fitting = [node for node in alive_nodes() if node["Resources"].get("CPU", 0.0) >= cpus]
            raise JobFailed(
                f"Ray could not place {count} partitions of {cpus} CPU ({STRATEGY}) within "
                f"{self.options.startup_timeout:g}s: {len(fitting)} nodes have that much CPU"
            )
        others = [self._actor(index) for index in range(1, count)]
        self.actors = others
        endpoints = get_within([actor.endpoint.remote() for actor in others], self.options.startup_timeout)
        addresses = layout(["", *(endpoint.target for endpoint in endpoints)])
        first = self._actor(0, addresses)
        self.actors = [first, *others]
        self.endpoints = [get_within([first.endpoint.remote()], self.options.startup_timeout)[0], *endpoints]
        self._told = (self.endpoints[0].node_id, self.endpoints[0].pid, addresses)

    def _actor(self, index: int, addresses: str = "") -> Any:
        assert self.placement is not None
        actor_class = ray.remote(PartitionServer).options(
            num_cpus=self.options.partition_cpus,
            max_restarts=self.options.partition_restarts,
            # As the workers': a lost node first shows as an actor that does not answer, and a
            # call waits for its restart (bounded by max_restarts) instead of failing meanwhile.
            max_task_retries=-1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index),
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
        )

    @property
    def target(self) -> str:
        """Partition 0's address as last seen."""
        return self.endpoints[0].target

    def resolver(self) -> PartitionZero:
        """Where partition 0 is now, for the workers and the evaluator."""
        return PartitionZero(self.actors[0])

    def look(self, looks: Looks, faults: FaultLog) -> None:
        """Ask each actor where it serves, without waiting: a new life is noted (a restart), and
        when one serves elsewhere than partition 0 announces, partition 0 is told."""
        for index, actor in enumerate(self.actors):
            self.endpoints[index] = looks.look(f"p{index}", actor.endpoint.remote) or self.endpoints[index]
        for endpoint in self.endpoints:
            place = ActorPlace(endpoint.node_id, endpoint.host, endpoint.metrics_port, endpoint.pid)
            faults.seen(partition_name(endpoint.index), place)
        first = self.endpoints[0]
        told = (first.node_id, first.pid, layout([endpoint.target for endpoint in self.endpoints]))
        if len(self.endpoints) > 1 and told != self._told:
            log.info("partition 0 (pid %d) told the layout %s", first.pid, told[2])
            self.actors[0].announce.remote(told[2])  # waits for its restart when it is down itself
            self._told = told

    def failed_for_good(self, looks: Looks) -> list[tuple[int, ray.exceptions.RayError]]:
        """Partitions whose actor Ray will not restart again (its restarts spent, or a restart that
        refused to start): their calls fail for good, unlike the unanswered ones of a restart."""
        failed = [(index, looks.error(f"p{index}")) for index in range(len(self.actors))]
        return [(index, error) for index, error in failed if isinstance(error, ray.exceptions.ActorDiedError)]

    def stop(self, faults: FaultLog, timeout: float) -> None:
        """Each partition shuts down gracefully (its final checkpoint). One last seen on a lost node
        is not asked: it has no server to stop, and its actor may still wait for a node."""
        standing = {i: actor for i, actor in enumerate(self.actors) if not faults.gone(partition_name(i))}
        if standing:
            codes = answers([actor.stop.remote() for actor in standing.values()], timeout)
            for index, code in zip(standing, codes, strict=True):
                if code != 0:
                    log.warning("partition %d stopped with status %s", index, code)

    def release(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
