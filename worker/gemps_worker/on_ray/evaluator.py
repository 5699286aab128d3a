"""The held-out evaluator of a Ray job, from the driver's side: started beside the workers, its
results collected as it makes them (every life's: a restarted evaluator starts empty), asked for
a final evaluation at the end. Its failure never fails the run."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray

from gemps.resolver import Resolver
from gemps_worker.on_ray.actors import HeldOutEvaluator
from gemps_worker.on_ray.calls import Looks, get_within
from gemps_worker.on_ray.faults import EVALUATOR, FaultLog, JobFailed
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.records import TimedEvaluation
from gemps_worker.on_ray.timeouts import LOOK_TIMEOUT, STOP_TIMEOUT
from gemps_worker.prometheus_targets import EVALUATOR_JOB, ScrapeTarget

log = logging.getLogger("gemps.ray")


class Evaluator:
    """The evaluator actor (None until started, and once killed) and the results it gave."""

    def __init__(self) -> None:
        self.actor: Any = None
        self.results: list[TimedEvaluation] = []
        self._failed = False  # its error is logged once

    def start(self, options: RayJobOptions, server: str, follow: Resolver) -> None:
        """Its actor, evaluating θ at `server` (partition 0) every `options.interval` seconds, and
        following partition 0 through `follow` when it moves."""
        evaluator_options = {
            "server": server,
            "dataset": options.dataset,
            "data_dir": options.data_dir,
            "model": options.model,
            "interval": options.interval,
        }
        restarts = options.worker_restarts  # its calls wait for its restart (-1), as the workers'
        self.actor = (
            ray.remote(HeldOutEvaluator)
            .options(num_cpus=options.evaluator_cpus, max_restarts=restarts, max_task_retries=-1)
            .remote(evaluator_options, follow)
        )

    def look(self, looks: Looks, faults: FaultLog) -> ScrapeTarget | None:
        """Without waiting: its new results kept, and where it serves /metrics (None while not known)."""
        actor, after = self.actor, self._evaluated()
        if actor is None:
            return None
        answer = looks.look("evaluations", lambda: actor.since.remote(after))
        if answer is not None:
            self._keep(answer)
        place = looks.look(EVALUATOR, actor.node.remote)
        if place is None:
            return None
        faults.seen(EVALUATOR, place)
        labels = {"ray_node": place.node_id}
        return ScrapeTarget(f"{place.address}:{place.metrics_port}", EVALUATOR_JOB, labels)

    def all(self) -> list[TimedEvaluation]:
        """Every evaluation of the run, asking the evaluator once more (waiting, unlike look())."""
        if self.actor is not None:
            with contextlib.suppress(JobFailed):
                self._keep(get_within([self.actor.since.remote(self._evaluated())], LOOK_TIMEOUT)[0])
        return list(self.results)

    def latest(self) -> TimedEvaluation | None:
        return self.results[-1] if self.results else None

    def _evaluated(self) -> float:
        return self.results[-1].time if self.results else 0.0

    def _keep(self, answer: tuple[list[TimedEvaluation], str]) -> None:
        """An answer of the evaluator's since(): its new results kept; its error logged once."""
        found, error = answer
        self.results.extend(result for result in found if result.time > self._evaluated())
        if error and not self._failed:
            self._failed = True
            log.warning("the evaluator stopped: %s", error)

    def final(self, faults: FaultLog) -> TimedEvaluation | None:
        """Stop the evaluator's loop and evaluate θ once more, as it is now (None without an
        evaluator, or when it fails: the run's other results still count). The life that answers
        is noted in `faults`: one restarted since the last look is a restart the job saw."""
        if self.actor is None:
            return None
        try:
            result: TimedEvaluation | None
            result, place = get_within([self.actor.final.remote(), self.actor.node.remote()], STOP_TIMEOUT)
        except JobFailed as error:
            log.warning("no final evaluation: %s", error)
            return None
        faults.seen(EVALUATOR, place)
        return result

    def kill(self) -> None:
        """Its actor released for good (no restart); a no-op when there is none."""
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
