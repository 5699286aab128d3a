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
- Replicas (--replicas R, DESIGN §3d): each partition is R server actors on distinct nodes, whose
  primary etcd decides: --etcd, or one the driver starts (`start_etcd`, which `gemps ray` gives:
  a private etcd on the driver's machine). A replica whose node is lost restarts elsewhere and
  rejoins as a backup, re-seeded by the primary; the workers go round partition 0's replicas
  (gemps_worker.on_ray.addresses) and the job goes on, the driver noting each new primary.
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
from typing import Any, Protocol

import ray
import ray.exceptions

from gemps.options import values_of
from gemps.records import GradientNoise, ServerStatus
from gemps_proto.status import PRIMARY
from gemps_worker.on_ray.actors import HeldOutEvaluator, TrainFunction, TrainingWorker
from gemps_worker.on_ray.calls import Looks, alive_nodes, answers, get_within
from gemps_worker.on_ray.faults import (
    EVALUATOR,
    RESULT_LOST,
    FaultLog,
    JobFailed,
    why,
    worker_name,
)
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.partitions import Partitions
from gemps_worker.on_ray.records import (
    ExportedModel,
    PartitionEndpoint,
    PrimaryChange,
    StatusSample,
    TimedEvaluation,
    WorkerOutcome,
)
from gemps_worker.prometheus_targets import EVALUATOR_JOB, SERVER_JOB, WORKER_JOB, ScrapeTarget, write_targets

log = logging.getLogger("gemps.ray")

TARGETS_FILE = "prometheus-targets.json"
STOP_TIMEOUT = 60.0  # seconds a worker gets to finish its step and leave, a partition to shut down
LOOK_TIMEOUT = 10.0  # seconds for a look at partition 0 or the evaluator before going on without it
#: seconds a sample waits for a replica's status: one on a node just lost does not answer until
#: Ray marks the node dead, and the others' (the new primary's) are what the sample is for
REPLICA_LOOK_TIMEOUT = 1.0

Progress = Callable[[StatusSample, TimedEvaluation | None], None]


class Etcd(Protocol):
    """An etcd the driver starts for a replicated job (gemps_server.replication.local_etcd.LocalEtcd:
    this package does not import the server, so `gemps ray` hands it over as `start_etcd`)."""

    endpoint: str

    def start(self) -> object: ...

    def stop(self) -> None: ...


#: makes an etcd whose clients reach it at the host it is given (the driver's address)
StartEtcd = Callable[[str], Etcd]


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
    WorkerOptions fields (by name) to what `options` sets. `start_etcd`: with --replicas > 1 and
    no `options.etcd`, makes the etcd the driver runs for the job's life, given the host the nodes
    reach the driver at (`gemps ray` gives LocalEtcd).
    """

    def __init__(
        self,
        options: RayJobOptions,
        *,
        train: TrainFunction | None = None,
        server_options: Mapping[str, object] | None = None,
        worker_options: Mapping[str, object] | None = None,
        name: str = "",
        start_etcd: StartEtcd | None = None,
    ) -> None:
        problems = options.problems()
        if options.replicas > 1 and not options.etcd and start_etcd is None:
            problems.append(
                "replicas need etcd: give etcd=http://HOST:2379 (--etcd), or start_etcd (`gemps ray` starts one)"
            )
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
        self._start_etcd = start_etcd
        self.etcd: Etcd | None = None  # the one the driver started
        self.primaries: dict[int, int] = {}  # partition -> its primary replica, as last sampled
        self.primary_changes: list[PrimaryChange] = []

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
        if self.options.replicas > 1:
            self.partition_group.etcd = self.options.etcd or self._started_etcd()
        self.partition_group.start()
        self._start_evaluator()
        self._start_workers()
        self.refresh()  # the partitions' targets now; the others' as they come up
        log.info("job %s: %d partitions on nodes %s", self.name, len(self.partitions), self.partition_nodes())

    def _started_etcd(self) -> str:
        """A private etcd for the job, on the driver's machine at the address Ray knows it by (or
        --host): every node must reach it there. Stopped with the job."""
        assert self._start_etcd is not None
        host = self.options.host or str(ray.util.get_node_ip_address())
        self.etcd = self._start_etcd(host)
        self.etcd.start()
        log.info("job %s: replicas elect their primaries through etcd at %s", self.name, self.etcd.endpoint)
        return self.etcd.endpoint

    def _warn_if_short(self) -> None:
        """Ray queues actors that do not fit (an autoscaler may add nodes for them): say so."""
        evaluator = self.options.evaluator_cpus if self.options.evaluate and self.train_function is None else 0.0
        needed = (
            self.options.partitions * self.options.replicas * self.options.partition_cpus
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
        stayed on the lost node, so its loss ends the job (not a replica's: the primary seeds it)."""
        self.faults.nodes(node["NodeID"] for node in alive_nodes())
        if not self.options.work_dir and self.options.replicas == 1:
            partitions = self.faults.lost_partitions()
            if partitions:
                raise JobFailed(partitions)

    def watch_partitions(self) -> None:
        """A partition Ray will not restart again ends the job, saying which, after how many
        restarts and why."""
        failed = self.partition_group.failed_for_good(self._looks)
        if failed:
            name, error = failed[0]
            message = self.faults.failure(name, error, self.options.partition_restarts, "--partition-restarts")
            raise JobFailed(message) from error

    def sample(self) -> StatusSample | None:
        """Partition 0's version now (None while it restarts), all of θ's noise scale (while all answer)."""
        if self.options.replicas > 1:
            return self._sample_replicas()
        statuses = answers([actor.status.remote() for actor in self.partition_actors], LOOK_TIMEOUT)
        if statuses[0] is None:
            return None
        noise = GradientNoise() if None in statuses else GradientNoise.combined([s.gradient_noise for s in statuses])
        sample = StatusSample(time.time(), statuses[0].version, statuses[0].active_workers, noise)
        self.samples.append(sample)
        return sample

    def _sample_replicas(self) -> StatusSample | None:
        """As sample(), of each partition's primary (partition 0's version: the highest a replica
        of it holds); a new primary is noted. Replicas last seen on a lost node are not asked."""
        group = self.partition_group
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
        node = self.partition_group.endpoints[slot].node_id
        self.primary_changes.append(PrimaryChange(time.time(), index, replica, node, previous, epoch))
        if previous >= 0:
            log.warning("partition %d: replica %d primary now (epoch %d), was %d", index, replica, epoch, previous)

    def primary_nodes(self) -> list[str]:
        """Each partition's primary's node, as last sampled (without replicas: its node; "" while
        no primary of it was seen)."""
        if self.options.replicas == 1:
            return self.partition_nodes()
        group = self.partition_group
        return [
            group.endpoints[group.slots(index)[self.primaries[index]]].node_id if index in self.primaries else ""
            for index in range(self.options.partitions)
        ]

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
        """θ and the buffers by name, pulled by partition 0's actor (with every partition's slice);
        replicated: by a standing replica of it, from whichever is primary."""
        if self.options.replicas == 1:
            model: ExportedModel = get_within([self.partition_actors[0].export.remote()], STOP_TIMEOUT)[0]
            return model
        group = self.partition_group
        standing = [actor for slot, actor in group.standing(self.faults).items() if slot in group.slots(0)]
        actor = standing[0] if standing else group.actors[0]
        replicated: ExportedModel = get_within([actor.export.remote(group.target)], STOP_TIMEOUT)[0]
        return replicated

    def partition_nodes(self) -> list[str]:
        """The node of every partition's server (with replicas: of every replica), as last seen."""
        return [endpoint.node_id for endpoint in self.partitions]

    def refresh(self) -> None:
        """Look at every actor again, without waiting (a restarted one may have a new process, a
        worker a new metrics port), and rewrite the Prometheus targets where something moved."""
        targets = dict(self._targets)
        self.partition_group.look(self._looks, self.faults)
        for slot, endpoint in enumerate(self.partitions):
            labels = {"partition": str(endpoint.index), "ray_node": endpoint.node_id}
            if self.options.replicas > 1:
                labels["replica"] = str(endpoint.replica)
            address = f"{endpoint.host}:{endpoint.metrics_port}"
            targets[self.partition_group.key(slot)] = ScrapeTarget(address, SERVER_JOB, labels)
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
            if self.etcd is not None:  # last: the replicas' leases needed it until they stopped
                self.etcd.stop()
                self.etcd = None
