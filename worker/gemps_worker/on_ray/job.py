"""The driver of a gemps job on a Ray cluster: place, start, follow, collect, stop.

    with RayJob(RayJobOptions(partitions=2, workers=8)) as job:  # partitions, evaluator, workers up
        outcomes = job.wait(on_progress=print)                    # until every worker is done
        model = job.export()                                      # θ and buffers, to the driver
    # leaving the block: workers leave, partitions stop gracefully (final checkpoints), all freed

- Partitions: one actor each, in a placement group of one bundle per partition, SPREAD
  (gemps_worker.on_ray.partitions). When a partition's node is lost, Ray places its bundle and
  restarts its actor on another node, from its newest checkpoint in --work-dir, on fresh ports;
  partition 0 announces the new layout, and the workers follow (partition 0 itself through its
  actor: gemps_worker.on_ray.addresses). The job fails only when a partition's restarts are spent.
- Workers: one actor each, SPREAD over the nodes (never pinned to one), with `max_restarts`.
  Ray retries their training call (`max_task_retries=-1`) on the restarted actor, on a
  surviving node when its node was lost, until those restarts are spent: a restarted worker
  registers again and trains its budget again. The evaluator likewise, and its loss never fails
  the run. The driver watches (gemps_worker.on_ray.faults): nodes lost and actors restarted go
  into the result, and a failure says which actor, after how many restarts and why.
- Everything is reached through actors, never from the driver directly, so the driver may run
  anywhere Ray reaches (the head, a laptop through Ray Client).
- Ctrl-C or `ray.cancel` of the task running the job raises KeyboardInterrupt in the driver;
  leaving the `with` block then stops everything in order, as at the end of a run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
import ray.exceptions

from gemps.options import values_of
from gemps.records import GradientNoise
from gemps_worker.on_ray.actors import HeldOutEvaluator, TrainFunction, TrainingWorker
from gemps_worker.on_ray.calls import Looks, alive_nodes, answers, get_within
from gemps_worker.on_ray.faults import (
    EVALUATOR,
    RESULT_LOST,
    FaultLog,
    JobFailed,
    partition_name,
    why,
    worker_name,
)
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.partitions import Partitions
from gemps_worker.on_ray.records import ExportedModel, PartitionEndpoint, StatusSample, TimedEvaluation, WorkerOutcome
from gemps_worker.prometheus_targets import EVALUATOR_JOB, SERVER_JOB, WORKER_JOB, ScrapeTarget, write_targets

log = logging.getLogger("gemps.ray")

TARGETS_FILE = "prometheus-targets.json"
STOP_TIMEOUT = 60.0  # seconds a worker gets to finish its step and leave, a partition to shut down
LOOK_TIMEOUT = 10.0  # seconds for a look at partition 0 or the evaluator before going on without it

Progress = Callable[[StatusSample, TimedEvaluation | None], None]


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """While stopping, a further Ctrl-C is noted, not raised, so the stop runs to its end. Ray's
    cancel of a running task is such an interrupt, repeated until the task ends (every couple of
    seconds): without this, a stop taking longer was cut short. Main thread only (signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: object) -> None:
        log.warning("interrupted again: still stopping the job")

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class RayJob:
    """A gemps job on the Ray cluster `options.address` names (a context manager).

    `train`: a user's training function run by every worker actor (`train(context)`, see
    WorkerContext); None runs the reference worker on `options.model` / `options.dataset` with
    the held-out evaluator beside it. `server_options` and `worker_options` add ServerConfig and
    WorkerOptions fields (by name) to what `options` sets.
    """

    def __init__(
        self,
        options: RayJobOptions,
        *,
        train: TrainFunction | None = None,
        server_options: Mapping[str, object] | None = None,
        worker_options: Mapping[str, object] | None = None,
        name: str = "",
    ) -> None:
        problems = options.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.options = options
        self.train_function = train
        self.server_options = {
            **values_of(options.training),
            "checkpoint_every": options.checkpoint_every,
            **(server_options or {}),
        }
        self.worker_options = {
            "dataset": options.dataset,
            "data_dir": options.data_dir,
            "model": options.model,
            "epochs": options.epochs,
            "wire_dtype": options.wire_dtype,
            **(worker_options or {}),
        }
        self.name = name or f"gemps-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.out = Path(options.out)
        self.nodes: list[str] = []
        self.partition_group = Partitions(self.name, options, self.server_options)
        self.worker_actors: list[Any] = []
        self.evaluator: Any = None
        self._evaluations: list[TimedEvaluation] = []  # every life's: a restarted evaluator starts empty
        self._evaluator_failed = False  # its error is logged once
        self.samples: list[StatusSample] = []
        self.faults = FaultLog()
        self._training: dict[Any, int] = {}  # train() call -> worker index
        self._targets: dict[str, ScrapeTarget] = {}
        self._looks = Looks()  # refresh()'s questions

    @property
    def target(self) -> str:
        """Partition 0's address as last seen: where workers register."""
        return self.partition_group.target

    @property
    def partitions(self) -> list[PartitionEndpoint]:
        """Where each partition serves, as last seen."""
        return self.partition_group.endpoints

    @property
    def partition_actors(self) -> list[Any]:
        return self.partition_group.actors

    # -- start ---------------------------------------------------------------------------------

    def __enter__(self) -> RayJob:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        if not ray.is_initialized():
            try:
                ray.init(address=self.options.address, log_to_driver=True)
            except ConnectionError as error:
                raise JobFailed(
                    f"cannot join the Ray cluster at {self.options.address!r} ({error}): start one with "
                    "`ray start --head`, or give --address"
                ) from error
        self.nodes = [node["NodeID"] for node in alive_nodes()]
        self.faults.nodes(self.nodes)
        self._warn_if_short()
        self.partition_group.start()
        self._start_evaluator()
        self._start_workers()
        self.refresh()  # the partitions' targets now; the others' as they come up
        log.info("job %s: %d partitions on nodes %s", self.name, len(self.partitions), self.partition_nodes())

    def _warn_if_short(self) -> None:
        """Ray queues actors that do not fit (an autoscaler may add nodes for them): say so."""
        evaluator = self.options.evaluator_cpus if self.options.evaluate and self.train_function is None else 0.0
        needed = (
            self.options.partitions * self.options.partition_cpus
            + self.options.workers * self.options.worker_cpus
            + evaluator
        )
        available = float(ray.cluster_resources().get("CPU", 0.0))
        if needed > available:
            log.warning(
                "the job reserves %g CPUs and the cluster has %g: some actors wait until CPUs free up or nodes "
                "join (lower --worker-cpus / --partition-cpus, or give `ray start` a larger --num-cpus)",
                needed,
                available,
            )

    def _start_evaluator(self) -> None:
        if not self.options.evaluate or self.train_function is not None:
            return
        options = {
            "server": self.target,
            "dataset": self.options.dataset,
            "data_dir": self.options.data_dir,
            "model": self.options.model,
            "interval": self.options.interval,
        }
        restarts = self.options.worker_restarts  # its calls wait for its restart (-1), as the workers'
        self.evaluator = (
            ray.remote(HeldOutEvaluator)
            .options(num_cpus=self.options.evaluator_cpus, max_restarts=restarts, max_task_retries=-1)
            .remote(options, self.partition_group.resolver())
        )

    def _start_workers(self) -> None:
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
        follow = self.partition_group.resolver()
        self.worker_actors = [
            actor_class.remote(
                index, count, self.target, options=self.worker_options, train=self.train_function, target=follow
            )
            for index in range(count)
        ]
        self._training = {actor.train.remote(): index for index, actor in enumerate(self.worker_actors)}

    # -- follow --------------------------------------------------------------------------------

    def wait(self, on_progress: Progress | None = None) -> list[WorkerOutcome]:
        """Until every worker is done, looking every `interval` seconds; each worker's outcome.

        Raises JobFailed when one failed for good, or a partition did (its restarts spent), or a
        partition's node was lost without --work-dir (the others keep running until stop())."""
        outcomes: dict[int, WorkerOutcome] = {}
        while self._training:
            pending = list(self._training)
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=self.options.interval)
            self.watch_nodes()  # first: what was lost explains a failure below
            for call in ready:
                index = self._training.pop(call)
                try:
                    outcomes[index] = ray.get(call)
                except RESULT_LOST as error:
                    log.warning("worker %d's outcome went with its node (%s): asking again", index, why(error))
                    self._training[self.worker_actors[index].train.remote()] = index
                except ray.exceptions.RayError as error:
                    message = self.faults.failure(worker_name(index), error, self.options.worker_restarts)
                    raise JobFailed(message) from error
            self.refresh()
            self.watch_partitions()
            sample = self.sample()
            if sample is not None and on_progress is not None:
                on_progress(sample, self.latest_evaluation())
        return [outcomes[index] for index in sorted(outcomes)]

    def watch_nodes(self) -> None:
        """Note the nodes Ray lost since the last look. Workers, the evaluator and partitions come
        back on their own, a partition from its checkpoints in --work-dir: without one they
        stayed on the lost node, so its loss ends the job."""
        self.faults.nodes(node["NodeID"] for node in alive_nodes())
        if not self.options.work_dir:
            partitions = self.faults.lost_partitions()
            if partitions:
                raise JobFailed(partitions)

    def watch_partitions(self) -> None:
        """A partition Ray will not restart again ends the job, saying which, after how many
        restarts and why."""
        failed = self.partition_group.failed_for_good(self._looks)
        if failed:
            index, error = failed[0]
            message = self.faults.failure(
                partition_name(index), error, self.options.partition_restarts, "--partition-restarts"
            )
            raise JobFailed(message) from error

    def sample(self) -> StatusSample | None:
        """Partition 0's version now (None while it restarts), all of θ's noise scale (while all answer)."""
        statuses = answers([actor.status.remote() for actor in self.partition_actors], LOOK_TIMEOUT)
        if statuses[0] is None:
            return None
        noise = GradientNoise() if None in statuses else GradientNoise.combined([s.gradient_noise for s in statuses])
        sample = StatusSample(time.time(), statuses[0].version, statuses[0].active_workers, noise)
        self.samples.append(sample)
        return sample

    def evaluations(self) -> list[TimedEvaluation]:
        """Every evaluation of the run, asking the evaluator once more (waiting, unlike refresh())."""
        if self.evaluator is not None:
            with contextlib.suppress(JobFailed):
                self._keep_evaluations(get_within([self.evaluator.since.remote(self._evaluated())], LOOK_TIMEOUT)[0])
        return list(self._evaluations)

    def latest_evaluation(self) -> TimedEvaluation | None:
        return self._evaluations[-1] if self._evaluations else None

    def _evaluated(self) -> float:
        return self._evaluations[-1].time if self._evaluations else 0.0

    def _keep_evaluations(self, answer: tuple[list[TimedEvaluation], str]) -> None:
        """An answer of the evaluator's since(): its new results kept; its error logged once."""
        found, error = answer
        self._evaluations.extend(result for result in found if result.time > self._evaluated())
        if error and not self._evaluator_failed:
            self._evaluator_failed = True
            log.warning("the evaluator stopped: %s", error)

    def final_evaluation(self) -> TimedEvaluation | None:
        """Stop the evaluator's loop and evaluate θ once more, as it is now (None without an
        evaluator, or when it fails: the run's other results still count)."""
        if self.evaluator is None:
            return None
        try:
            result: TimedEvaluation | None = get_within([self.evaluator.final.remote()], STOP_TIMEOUT)[0]
        except JobFailed as error:
            log.warning("no final evaluation: %s", error)
            return None
        return result

    def export(self) -> ExportedModel:
        """θ and the buffers by name, pulled by partition 0's actor (with every partition's slice)."""
        model: ExportedModel = get_within([self.partition_actors[0].export.remote()], STOP_TIMEOUT)[0]
        return model

    def partition_nodes(self) -> list[str]:
        return [endpoint.node_id for endpoint in self.partitions]

    def refresh(self) -> None:
        """Look at every actor again, without waiting (a restarted one may have a new process, a
        worker a new metrics port), and rewrite the Prometheus targets where something moved."""
        targets = dict(self._targets)
        self.partition_group.look(self._looks, self.faults)
        for endpoint in self.partitions:
            labels = {"partition": str(endpoint.index), "ray_node": endpoint.node_id}
            targets[f"p{endpoint.index}"] = ScrapeTarget(f"{endpoint.host}:{endpoint.metrics_port}", SERVER_JOB, labels)
        for index, actor in enumerate(self.worker_actors):
            place = self._looks.look(f"w{index}", actor.node.remote)
            if place is not None:
                self.faults.seen(worker_name(index), place)
                if place.metrics_port > 0:
                    labels = {"worker": str(index), "ray_node": place.node_id}
                    targets[f"w{index}"] = ScrapeTarget(f"{place.address}:{place.metrics_port}", WORKER_JOB, labels)
        if self.evaluator is not None:
            evaluator, after = self.evaluator, self._evaluated()
            answer = self._looks.look("evaluations", lambda: evaluator.since.remote(after))
            if answer is not None:
                self._keep_evaluations(answer)
            place = self._looks.look(EVALUATOR, evaluator.node.remote)
            if place is not None:
                self.faults.seen(EVALUATOR, place)
                labels = {"ray_node": place.node_id}
                targets["evaluator"] = ScrapeTarget(f"{place.address}:{place.metrics_port}", EVALUATOR_JOB, labels)
        if targets != self._targets:
            self._targets = targets
            write_targets(self.out / TARGETS_FILE, targets.values())

    # -- stop ----------------------------------------------------------------------------------

    def stop_workers(self) -> None:
        """Workers finish their step and leave the server; then their actors are released. One
        last seen on a lost node is not asked: nothing of it runs, and its restart may wait for
        room on another node."""
        standing = [actor for i, actor in enumerate(self.worker_actors) if not self.faults.gone(worker_name(i))]
        if standing:
            answers([actor.stop.remote() for actor in standing], STOP_TIMEOUT)
        for actor in self.worker_actors:
            ray.kill(actor, no_restart=True)
        self.worker_actors, self._training = [], {}

    def stop(self) -> None:
        """Workers leave, the evaluator ends, partitions shut down gracefully (each writes its
        final checkpoint), then every actor and the placement group are released. Safe to call
        twice, and after a failed start."""
        with interrupts_deferred():
            self._stop()

    def _stop(self) -> None:
        try:
            self.stop_workers()
            if self.evaluator is not None:  # before the partitions go: it would only retry them
                ray.kill(self.evaluator, no_restart=True)
                self.evaluator = None
            self.partition_group.stop(self.faults, STOP_TIMEOUT)
        finally:  # whatever went wrong above, nothing of the job is left holding the cluster
            evaluator = [] if self.evaluator is None else [self.evaluator]
            for actor in [*self.worker_actors, *evaluator]:
                ray.kill(actor, no_restart=True)
            self.worker_actors, self.evaluator = [], None
            self.partition_group.release()
