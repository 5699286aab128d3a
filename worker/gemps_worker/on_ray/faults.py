"""What the driver of a Ray job sees go wrong and come back: nodes Ray marks dead, actors with a
new life, and the words of a failure.

Ray itself retries a call whose actor died or stopped answering (the worker and evaluator actors
have `max_task_retries=-1`): on the actor it restarts, on a surviving node when the old one was
lost, until the actor's `max_restarts` is spent. The driver does not resubmit those calls. It
watches: the lives it sees (node, pid) and the nodes Ray marks dead go into the job's summary,
and when a call fails for good, `FaultLog.failure` says which actor, after how many restarts and
why. A partition's actor is restarted the same way, on another node when its node was lost,
from its checkpoints in --work-dir; without a --work-dir they stayed on the lost node, so losing
a partition's node then ends the job, with a message that says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import ray.exceptions

from gemps_worker.on_ray.records import ActorPlace, ActorRestart, NodeLoss

log = logging.getLogger("gemps.ray")

#: the call finished but its result went with its node (kept in that node's object store, not
#: inlined): ask the actor again; its restarted life trains again, a live one answers the same
RESULT_LOST = (ray.exceptions.ObjectLostError,)

EVALUATOR = "evaluator"
PARTITION = "partition"


class JobFailed(RuntimeError):
    """A worker or a partition failed for good (its restarts spent, or a training function
    raised), or a partition's node was lost without --work-dir."""


def worker_name(index: int) -> str:
    return f"worker {index}"


def partition_name(index: int) -> str:
    return f"{PARTITION} {index}"


def replica_name(index: int, replica: int) -> str:
    return f"{PARTITION} {index} replica {replica}"


def why(error: BaseException) -> str:
    """One line: the error's type and its last plain line (Ray's actor errors end with the cause,
    after tab-indented fields)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("\t")]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


class FaultLog:
    """The nodes and actor lives the driver has seen: which nodes were lost, which actors came back."""

    def __init__(self) -> None:
        self.known: set[str] = set()  # every node seen alive
        self.places: dict[str, ActorPlace] = {}  # each actor's newest life seen
        self.restarts: list[ActorRestart] = []
        self.losses: list[NodeLoss] = []

    def nodes(self, alive: Iterable[str]) -> list[NodeLoss]:
        """Note the nodes Ray has alive now; return those newly lost, with the actors they held."""
        alive = set(alive)
        lost_before = {loss.node_id for loss in self.losses}
        now = time.time()
        new = [NodeLoss(now, node, self.held(node)) for node in sorted(self.known - alive - lost_before)]
        self.known |= alive
        for loss in new:
            log.warning("Ray node %s was lost, holding %s", loss.node_id[:12], ", ".join(loss.held) or "none of ours")
        self.losses.extend(new)
        return new

    def held(self, node: str) -> tuple[str, ...]:
        return tuple(actor for actor, place in self.places.items() if place.node_id == node)

    def lost(self, node: str) -> bool:
        return any(loss.node_id == node for loss in self.losses)

    def seen(self, actor: str, place: ActorPlace) -> None:
        """An answer from `actor`: a life other than the last one seen is a restart."""
        previous = self.places.get(actor)
        self.places[actor] = place
        if previous is None or previous.life == place.life:
            return
        lost = self.lost(previous.node_id)
        self.restarts.append(ActorRestart(actor, time.time(), place.node_id, previous.node_id, lost))
        cause = "its node was lost" if lost else "its process died"
        log.warning("%s restarted on node %s (%s)", actor, place.node_id[:12], cause)

    def gone(self, actor: str) -> bool:
        """`actor`'s newest life seen ran on a node since lost: nothing of it is left to ask."""
        place = self.places.get(actor)
        return place is not None and self.lost(place.node_id)

    def restarts_of(self, actor: str) -> int:
        return sum(restart.actor == actor for restart in self.restarts)

    def lost_partitions(self) -> str:
        """Why the job cannot go on when a partition's node was lost without --work-dir ('' while
        none was)."""
        held = [(actor, loss.node_id) for loss in self.losses for actor in loss.held]
        lost = [(actor, node) for actor, node in held if actor.startswith(f"{PARTITION} ")]
        if not lost:
            return ""
        which = ", ".join(f"{actor} (node {node[:12]})" for actor, node in lost)
        return (
            f"lost the node of {which}: its checkpoints were on that node (no --work-dir), so it cannot "
            "move to another node and the job cannot go on. Give --work-dir on storage every node sees: "
            "a partition then moves with its checkpoints"
        )

    def failure(self, actor: str, error: BaseException, allowed: int, flag: str = "--worker-restarts") -> str:
        """Why the job ends, `actor`'s call having failed with `error` (restarts `allowed` by `flag`)."""
        if not isinstance(error, ray.exceptions.RayActorError):  # its own error: the training function raised
            return f"{actor} failed: {error}"
        place = self.places.get(actor)
        node = f"its node {place.node_id[:12]} was lost; " if place is not None and self.gone(actor) else ""
        count = self.restarts_of(actor)
        return (
            f"{actor} failed for good after {count} restart{'' if count == 1 else 's'} "
            f"({flag} {allowed}): {node}{why(error)}"
        )
