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
- The driver's parts: the partitions (gemps_worker.on_ray.partitions), the workers
  (gemps_worker.on_ray.workers), the evaluator (gemps_worker.on_ray.evaluator), the progress
  samples and the primaries seen (gemps_worker.on_ray.sampling); this module runs them in order.
- Everything is reached through actors, never from the driver directly, so the driver may run
  anywhere Ray reaches (the head, a laptop through Ray Client).
- Ctrl-C or `ray.cancel` of the task running the job raises KeyboardInterrupt in the driver;
  leaving the `with` block then stops everything in order, as at the end of a run.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import ray

from gemps.options import values_of
from gemps_worker.on_ray.actors import TrainFunction
from gemps_worker.on_ray.calls import Looks, alive_nodes, get_within
from gemps_worker.on_ray.etcd import Etcd, StartEtcd
from gemps_worker.on_ray.evaluator import Evaluator
from gemps_worker.on_ray.faults import FaultLog, JobFailed
from gemps_worker.on_ray.interrupts import interrupts_deferred
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
from gemps_worker.on_ray.sampling import Sampler
from gemps_worker.on_ray.timeouts import STOP_TIMEOUT
from gemps_worker.on_ray.workers import Workers
from gemps_worker.prometheus_targets import SERVER_JOB, ScrapeTarget, write_targets

log = logging.getLogger("gemps.ray")

TARGETS_FILE = "prometheus-targets.json"

Progress = Callable[[StatusSample, TimedEvaluation | None], None]


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
        self.workers = Workers(options, self.worker_options, train)
        self.held_out = Evaluator()
        self.faults = FaultLog()
        self.sampler = Sampler(options, self.partition_group, self.faults)
        self._targets: dict[str, ScrapeTarget] = {}
        self._looks = Looks()  # refresh()'s questions
        self._start_etcd = start_etcd
        self.etcd: Etcd | None = None  # the one the driver started

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

    @property
    def worker_actors(self) -> list[Any]:
        return self.workers.actors

    @property
    def evaluator(self) -> Any:
        """The held-out evaluator's actor (None without one)."""
        return self.held_out.actor

    @property
    def samples(self) -> list[StatusSample]:
        return self.sampler.samples

    @property
    def primaries(self) -> dict[int, int]:
        """Partition -> its primary replica, as last sampled."""
        return self.sampler.primaries

    @property
    def primary_changes(self) -> list[PrimaryChange]:
        return self.sampler.primary_changes

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
        if self.options.evaluate and self.train_function is None:
            self.held_out.start(self.options, self.target, self.partition_group.resolver())
        self.workers.start(self.target, self.partition_group.resolver())
        self.refresh()  # the partitions' targets now; the others' as they come up
        log.info("job %s: %d partitions on nodes %s", self.name, len(self.partitions), self.partition_nodes())

    def _started_etcd(self) -> str:
        """A private etcd for the job, on the driver's machine at the address Ray knows it by (or
        --host): every node must reach it there. Stopped with the job."""
        assert self._start_etcd is not None
        host = self.options.host or str(ray.util.get_node_ip_address())
        self.etcd = self._start_etcd(host)
        self.etcd.start()
        self.partition_group.etcd_pems = self.etcd.client_pems()  # it admits only holders of these
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

    # -- follow --------------------------------------------------------------------------------

    def wait(self, on_progress: Progress | None = None) -> list[WorkerOutcome]:
        """Until every worker is done, looking every `interval` seconds; each worker's outcome.

        Raises JobFailed when one failed for good, or a partition did (its restarts spent), or a
        partition's node was lost without --work-dir (the others keep running until stop())."""
        outcomes: dict[int, WorkerOutcome] = {}
        while self.workers.training:
            ended = self.workers.finished_within(self.options.interval)
            self.watch_nodes()  # first: what was lost explains a failure below
            outcomes |= self.workers.outcomes(ended, self.faults)
            self.refresh()
            self.watch_partitions()
            self.watch_etcd()
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

    def watch_etcd(self) -> None:
        """The private etcd, dead, is started again on its data, endpoint and certificates (as
        `gemps server --replicas`' supervisor does): the replicas reconnect by themselves. One that
        does not come back is tried again at the next look."""
        if self.etcd is None or self.etcd.running():
            return
        log.warning("job %s: the private etcd exited; starting it again on its data", self.name)
        try:
            self.etcd.restart()
        except OSError as error:
            log.error("job %s: the private etcd did not start again (%s); trying again", self.name, error)

    def sample(self) -> StatusSample | None:
        """Partition 0's version now (None while it restarts), all of θ's noise scale (while all answer)."""
        return self.sampler.sample()

    def primary_nodes(self) -> list[str]:
        """Each partition's primary's node, as last sampled (without replicas: its node; "" while
        no primary of it was seen)."""
        return self.sampler.primary_nodes()

    def evaluations(self) -> list[TimedEvaluation]:
        """Every evaluation of the run, asking the evaluator once more (waiting, unlike refresh())."""
        return self.held_out.all()

    def latest_evaluation(self) -> TimedEvaluation | None:
        return self.held_out.latest()

    def final_evaluation(self) -> TimedEvaluation | None:
        """Stop the evaluator's loop and evaluate θ once more, as it is now (None without an
        evaluator, or when it fails: the run's other results still count)."""
        return self.held_out.final(self.faults)

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
        targets |= self.workers.look(self._looks, self.faults)
        evaluator = self.held_out.look(self._looks, self.faults)
        if evaluator is not None:
            targets["evaluator"] = evaluator
        if targets != self._targets:
            self._targets = targets
            write_targets(self.out / TARGETS_FILE, targets.values())

    # -- stop ----------------------------------------------------------------------------------

    def stop_workers(self) -> None:
        """Workers finish their step and leave the server; then their actors are released. One
        last seen on a lost node is not asked: nothing of it runs, and its restart may wait for
        room on another node."""
        self.workers.stop(self.faults)

    def stop(self) -> None:
        """Workers leave, the evaluator ends, partitions shut down gracefully (each writes its
        final checkpoint), then every actor and the placement group are released. Safe to call
        twice, and after a failed start."""
        with interrupts_deferred():
            self._stop()

    def _stop(self) -> None:
        try:
            self.stop_workers()
            self.held_out.kill()  # before the partitions go: it would only retry them
            self.partition_group.stop(self.faults, STOP_TIMEOUT)
        finally:  # whatever went wrong above, nothing of the job is left holding the cluster
            self.workers.kill()
            self.held_out.kill()
            self.partition_group.release()
            if self.etcd is not None:  # last: the replicas' leases needed it until they stopped
                self.etcd.stop()
                self.etcd = None
