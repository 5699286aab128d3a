"""Run a gemps job on Ray to its end and collect what it made to the driver: `run_job`, what
`gemps ray` and scripts call; RayJob (gemps_worker.on_ray.job) is the job itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gemps_worker.on_ray.actors import TrainFunction
from gemps_worker.on_ray.etcd import StartEtcd
from gemps_worker.on_ray.interrupts import interrupts_deferred
from gemps_worker.on_ray.job import Progress, RayJob
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.records import (
    ActorRestart,
    ExportedModel,
    NodeLoss,
    PartitionEndpoint,
    PrimaryChange,
    StatusSample,
    TimedEvaluation,
    WorkerOutcome,
)

log = logging.getLogger("gemps.ray")


@dataclass
class RayJobResult:
    """What `run_job` collected; `stopped`: ended by Ctrl-C or ray.cancel before the workers finished."""

    name: str
    nodes: list[str]  # Ray node ids alive at the start
    partitions: list[PartitionEndpoint]
    outcomes: list[WorkerOutcome]
    export: ExportedModel
    evaluations: list[TimedEvaluation] = field(default_factory=list)
    samples: list[StatusSample] = field(default_factory=list)
    final: TimedEvaluation | None = None
    stopped: bool = False
    seconds: float = 0.0
    restarts: list[ActorRestart] = field(default_factory=list)  # new lives of actors, as the driver saw them
    node_losses: list[NodeLoss] = field(default_factory=list)
    primary_changes: list[PrimaryChange] = field(default_factory=list)  # replicated partitions' primaries seen


def run_job(
    options: RayJobOptions,
    *,
    train: TrainFunction | None = None,
    server_options: Mapping[str, object] | None = None,
    worker_options: Mapping[str, object] | None = None,
    on_progress: Progress | None = None,
    start_etcd: StartEtcd | None = None,
) -> RayJobResult:
    """Run a job to its end (or to Ctrl-C / ray.cancel: then `stopped`), with the export, the
    evaluations and where everything ran collected to the driver. `start_etcd`: RayJob's."""
    started = time.monotonic()
    job = RayJob(
        options, train=train, server_options=server_options, worker_options=worker_options, start_etcd=start_etcd
    )
    with job:
        return follow_job(job, on_progress, started)


def follow_job(job: RayJob, on_progress: Progress | None = None, started: float | None = None) -> RayJobResult:
    """Follow a started job to its end and collect its result, then stop it (as run_job does; for
    code that needs the job's handles while it runs, as the node-loss test's progress callback
    does). `started`: time.monotonic() the job's seconds count from (default: now)."""
    started = time.monotonic() if started is None else started
    stopped = False
    try:
        outcomes = job.wait(on_progress)
    except KeyboardInterrupt:
        stopped, outcomes = True, []
    with interrupts_deferred():
        if stopped:
            log.warning("interrupted: stopping the workers")
            job.stop_workers()
        final = job.final_evaluation()
        result = RayJobResult(
            job.name,
            job.nodes,
            job.partitions,
            outcomes,
            job.export(),
            job.evaluations(),
            job.samples,
            final,
            stopped,
            time.monotonic() - started,
            job.faults.restarts,
            job.faults.losses,
            job.primary_changes,
        )
        job.stop()  # here, still deferring interrupts (leaving the caller's `with` would stop it again: a no-op)
    return result
