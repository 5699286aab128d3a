"""The worker actors of a Ray job, from the driver's side: started SPREAD over the nodes, their
training calls followed to their outcomes (asked again when an outcome went with its node),
looked at for their metrics endpoints, stopped."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import ray
import ray.exceptions

from gemps.resolver import Resolver
from gemps_worker.on_ray.actors import TrainFunction, TrainingWorker
from gemps_worker.on_ray.calls import Looks, answers
from gemps_worker.on_ray.faults import RESULT_LOST, FaultLog, JobFailed, why, worker_name
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.records import WorkerOutcome
from gemps_worker.on_ray.timeouts import STOP_TIMEOUT
from gemps_worker.prometheus_targets import WORKER_JOB, ScrapeTarget

log = logging.getLogger("gemps.ray")


class Workers:
    """A job's worker actors and their training calls under way."""

    def __init__(self, options: RayJobOptions, worker_options: Mapping[str, object], train: TrainFunction | None):
        self.options = options
        self.worker_options = worker_options
        self.train_function = train
        self.actors: list[Any] = []
        self.training: dict[Any, int] = {}  # train() call -> worker index

    def start(self, server: str, follow: Resolver) -> None:
        """Every worker actor, registering at `server` (partition 0) and following it through
        `follow`, and its training call."""
        actor_class = ray.remote(TrainingWorker).options(
            num_cpus=self.options.worker_cpus,
            num_gpus=self.options.worker_gpus,
            max_restarts=self.options.worker_restarts,
            # Retry a call until the actor is back or its restarts are spent: a lost node first
            # shows as an actor that does not answer (ActorUnavailableError), for as long as Ray
            # takes to mark the node dead, and a bounded count of retries is spent in seconds.
            max_task_retries=-1,
            max_concurrency=4,  # train(), a retried train() waiting on it, stop(), node()
            scheduling_strategy="SPREAD",  # not a placement group: a restart may land on any node
        )
        count = self.options.workers
        self.actors = [
            actor_class.remote(
                index, count, server, options=self.worker_options, train=self.train_function, target=follow
            )
            for index in range(count)
        ]
        self.training = {actor.train.remote(): index for index, actor in enumerate(self.actors)}

    def finished_within(self, timeout: float) -> list[Any]:
        """The training calls that ended within `timeout` seconds (each ends once, for good or not)."""
        pending = list(self.training)
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
        return list(ready)

    def still_training(self) -> set[int]:
        """The workers whose training call has not ended, without waiting."""
        pending = list(self.training)
        if not pending:
            return set()
        _, waiting = ray.wait(pending, num_returns=len(pending), timeout=0)
        return {self.training[call] for call in waiting}

    def outcomes(self, ended: list[Any], faults: FaultLog) -> dict[int, WorkerOutcome]:
        """The outcomes of `ended` training calls by worker index. A worker whose outcome went
        with its node is asked again; JobFailed when one failed for good (its restarts spent)."""
        found: dict[int, WorkerOutcome] = {}
        for call in ended:
            index = self.training.pop(call)
            try:
                outcome: WorkerOutcome = ray.get(call)
                if outcome.life is not None:
                    faults.seen(worker_name(index), outcome.life)
                found[index] = outcome
            except RESULT_LOST as error:
                log.warning("worker %d's outcome went with its node (%s): asking again", index, why(error))
                self.training[self.actors[index].train.remote()] = index
            except ray.exceptions.RayError as error:
                message = faults.failure(worker_name(index), error, self.options.worker_restarts)
                raise JobFailed(message) from error
        return found

    def look(self, looks: Looks, faults: FaultLog) -> dict[str, ScrapeTarget]:
        """Without waiting: where each worker runs now (noted in `faults`), and the metrics
        endpoints of those that serve one, by scrape key."""
        targets: dict[str, ScrapeTarget] = {}
        for index, actor in enumerate(self.actors):
            place = looks.look(f"w{index}", actor.node.remote)
            if place is not None:
                faults.seen(worker_name(index), place)
                if place.metrics_port > 0:
                    labels = {"worker": str(index), "ray_node": place.node_id}
                    targets[f"w{index}"] = ScrapeTarget(f"{place.address}:{place.metrics_port}", WORKER_JOB, labels)
        return targets

    def stop(self, faults: FaultLog) -> None:
        """Workers finish their step and leave the server; then their actors are released. One
        last seen on a lost node is not asked: nothing of it runs, and its restart may wait for
        room on another node."""
        standing = [actor for i, actor in enumerate(self.actors) if not faults.gone(worker_name(i))]
        if standing:
            answers([actor.stop.remote() for actor in standing], STOP_TIMEOUT)
        self.kill()
        self.training = {}

    def kill(self) -> None:
        """Every worker actor released for good (no restart)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
