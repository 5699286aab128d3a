"""The driver's periodic look at a Ray job's progress: partition 0's version and all of θ's
gradient noise scale in a sample, and, with replicated partitions, which replica is each one's
primary (a new primary noted as a change)."""

from __future__ import annotations

import logging
import time

from gemps.records import GradientNoise, ServerStatus
from gemps_proto.status import PRIMARY
from gemps_worker.on_ray.calls import answers
from gemps_worker.on_ray.faults import FaultLog
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.partitions import Partitions
from gemps_worker.on_ray.records import PrimaryChange, StatusSample
from gemps_worker.on_ray.timeouts import LOOK_TIMEOUT, REPLICA_LOOK_TIMEOUT

log = logging.getLogger("gemps.ray")


class Sampler:
    """The samples of a job's partitions so far, and their primaries as last sampled."""

    def __init__(self, options: RayJobOptions, partitions: Partitions, faults: FaultLog) -> None:
        self.options = options
        self.partitions = partitions
        self.faults = faults
        self.samples: list[StatusSample] = []
        self.primaries: dict[int, int] = {}  # partition -> its primary replica, as last sampled
        self.primary_changes: list[PrimaryChange] = []

    def sample(self) -> StatusSample | None:
        """Partition 0's version now (None while it restarts), all of θ's noise scale (while all answer)."""
        if self.options.replicas > 1:
            return self._sample_replicas()
        statuses = answers([actor.status.remote() for actor in self.partitions.actors], LOOK_TIMEOUT)
        if statuses[0] is None:
            return None
        noise = GradientNoise() if None in statuses else GradientNoise.combined([s.gradient_noise for s in statuses])
        sample = StatusSample(time.time(), statuses[0].version, statuses[0].active_workers, noise)
        self.samples.append(sample)
        return sample

    def _sample_replicas(self) -> StatusSample | None:
        """As sample(), of each partition's primary (partition 0's version: the highest a replica
        of it holds); a new primary is noted. Replicas last seen on a lost node are not asked."""
        group = self.partitions
        standing = group.standing(self.faults)
        found = answers([actor.status.remote() for actor in standing.values()], REPLICA_LOOK_TIMEOUT)
        statuses: dict[int, ServerStatus] = {slot: s for slot, s in zip(standing, found, strict=True) if s is not None}
        primaries: list[ServerStatus | None] = []
        for index in range(self.options.partitions):
            mine = {slot: statuses[slot] for slot in group.slots(index) if slot in statuses}
            primary = next((slot for slot, s in mine.items() if s.replication and s.replication.role == PRIMARY), None)
            primaries.append(None if primary is None else mine[primary])
            if primary is not None:
                self._note_primary(index, primary, mine[primary])
        zero = [statuses[slot] for slot in group.slots(0) if slot in statuses]
        if not zero:
            return None
        newest = max(zero, key=lambda status: status.version)
        noise = GradientNoise()
        if None not in primaries:
            noise = GradientNoise.combined([status.gradient_noise for status in primaries if status is not None])
        active = primaries[0].active_workers if primaries[0] is not None else newest.active_workers
        sample = StatusSample(time.time(), newest.version, active, noise)
        self.samples.append(sample)
        return sample

    def _note_primary(self, index: int, slot: int, status: ServerStatus) -> None:
        replica = slot - index * self.options.replicas
        previous = self.primaries.get(index, -1)
        if previous == replica:
            return
        self.primaries[index] = replica
        epoch = status.replication.epoch if status.replication is not None else 0
        node = self.partitions.endpoints[slot].node_id
        self.primary_changes.append(PrimaryChange(time.time(), index, replica, node, previous, epoch))
        if previous >= 0:
            log.warning("partition %d: replica %d primary now (epoch %d), was %d", index, replica, epoch, previous)

    def primary_nodes(self) -> list[str]:
        """Each partition's primary's node, as last sampled (without replicas: its node; "" while
        no primary of it was seen)."""
        group = self.partitions
        if self.options.replicas == 1:
            return [endpoint.node_id for endpoint in group.endpoints]
        return [
            group.endpoints[group.slots(index)[self.primaries[index]]].node_id if index in self.primaries else ""
            for index in range(self.options.partitions)
        ]
