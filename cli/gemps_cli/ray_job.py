"""`gemps ray`: train on a Ray cluster: the partitions, workers and evaluator as Ray actors.

Joins the cluster --address names (`ray start --head` on this machine: the default, auto), places
the --partitions server processes on distinct nodes where there are enough, starts --workers
reference workers (or your --train function) spread over the nodes, follows the run, and writes
to --out on this machine: model.safetensors (θ and buffers by name, pulled at the end),
summary.json (where each partition ran, each worker's outcome, the held-out curve, the nodes lost
and the actors Ray restarted) and
prometheus-targets.json (a file_sd_configs list of every metrics endpoint). Ctrl-C stops the job
cleanly: workers leave, partitions write their final checkpoints, the export is still written.

With --replicas R each partition runs as R server processes on distinct nodes, whose primary etcd
decides: --etcd, else a private etcd this command starts on this machine, at its address as Ray
knows it (or --host), for the job's life (docs/RAY.md, "Replicas").
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from gemps_cli import environment
from gemps_cli.checked import add_training_arguments, checked_options
from gemps_server.checkpoint_files import export_state_dict
from gemps_server.replication import LocalEtcd
from gemps_worker.on_ray import JobFailed, RayJobOptions, RayJobResult, run_job
from gemps_worker.on_ray.actors import TrainFunction
from gemps_worker.on_ray.records import StatusSample, TimedEvaluation
from gemps_worker.signals import configure_logging

EXIT_INTERRUPTED = 130
PRINT_EVERY = 5.0  # seconds between progress lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    add_training_arguments(parser, RayJobOptions)
    environment.add_strict_flag(parser)
    parser.add_argument(
        "--train",
        default="",
        metavar="MODULE:FUNCTION",
        help="run this function in every worker actor instead of the reference worker: it gets a "
        "gemps_worker.on_ray.WorkerContext (its .server for RemoteOptimizer/RemoteModel) and must be "
        "importable on every node (installed, or shipped with `ray job submit --working-dir`)",
    )
    parser.set_defaults(run=run)


def training_function(spec: str) -> TrainFunction:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--train {spec!r}: give MODULE:FUNCTION")
    function: TrainFunction = getattr(importlib.import_module(module), name)
    return function


class _Progress:
    """A line every few seconds: version, commits/s since the last line, held-out accuracy, and how
    many workers the gradient noise scale says pay."""

    def __init__(self) -> None:
        self.last: StatusSample | None = None

    def __call__(self, sample: StatusSample, evaluation: TimedEvaluation | None) -> None:
        if self.last is not None and sample.time - self.last.time < PRINT_EVERY:
            return
        rate = 0.0 if self.last is None else (sample.version - self.last.version) / (sample.time - self.last.time)
        held_out = "" if evaluation is None else f"  held-out acc {evaluation.accuracy:6.2%} (v{evaluation.version})"
        noise = sample.gradient_noise
        pay = f"  noise scale {noise.scale:.0f} (~{noise.useful_workers:.1f} pay)"
        print(
            f"v{sample.version:<7d} {rate:6.1f} commits/s  workers {sample.active_workers}{pay}{held_out}", flush=True
        )
        self.last = sample


def private_etcd(host: str) -> LocalEtcd:
    """The job's etcd when --replicas > 1 and no --etcd: on this machine, where the nodes reach it."""
    return LocalEtcd(name="gemps-ray", host=host)


def run(args: argparse.Namespace) -> int:
    job = checked_options(RayJobOptions, args, "ray")
    if job is None:
        return 2
    try:
        train = training_function(args.train) if args.train else None
    except (ValueError, ImportError, AttributeError) as error:
        print(f"gemps ray: {error}", file=sys.stderr)
        return 2
    configure_logging()
    what = args.train or f"{job.model} on {job.dataset}, {job.epochs} epochs each"
    replicas = f" x {job.replicas} replicas" if job.replicas > 1 else ""
    print(f"gemps ray: {job.partitions} partitions{replicas}, {job.workers} workers ({what}), rule={job.training.rule}")
    try:
        result = run_job(job, train=train, on_progress=_Progress(), start_etcd=private_etcd)
    except JobFailed as error:
        print(f"gemps ray: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the workers started: nothing to collect
        print("gemps ray: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    write_outputs(Path(job.out), result)
    return EXIT_INTERRUPTED if result.stopped else 0


def write_outputs(out: Path, result: RayJobResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model.safetensors"
    source = {"source": f"ray job {result.name}"}
    export_state_dict(result.export.tensors, result.export.version, model, metadata=source)
    summary = {
        "job": result.name,
        "seconds": result.seconds,
        "stopped": result.stopped,
        "nodes": result.nodes,
        "partitions": [asdict(endpoint) for endpoint in result.partitions],
        "workers": [{k: v for k, v in asdict(o).items() if k != "value"} for o in result.outcomes],
        "export": {"file": str(model), "version": result.export.version},
        "final": None if result.final is None else asdict(result.final),
        "evaluations": [asdict(e) for e in result.evaluations],
        "samples": [asdict(s) for s in result.samples],
        "node_losses": [asdict(loss) for loss in result.node_losses],
        "restarts": [asdict(restart) for restart in result.restarts],
        "primary_changes": [asdict(change) for change in result.primary_changes],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    replicated = any(e.replica for e in result.partitions)
    nodes = ", ".join(
        f"{e.index}{f'/{e.replica}' if replicated else ''}: {e.node_id[:12]} ({e.target})" for e in result.partitions
    )
    print(f"partitions on Ray nodes  {nodes}")
    workers = sum(o.commits for o in result.outcomes)
    ending = " (stopped before the end)" if result.stopped else ""
    print(f"done in {result.seconds:.0f}s{ending}: version {result.export.version}, {workers} commits by the workers")
    for loss in result.node_losses:
        print(f"lost Ray node {loss.node_id[:12]}, holding {', '.join(loss.held) or 'none of the job'}")
    for restart in result.restarts:
        cause = "its node lost" if restart.node_lost else "its process died"
        print(f"restarted {restart.actor} on Ray node {restart.node_id[:12]} ({cause})")
    for change in result.primary_changes:
        if change.previous >= 0:  # the first primary of each partition is no news
            print(
                f"partition {change.partition}: replica {change.replica} became primary on Ray node "
                f"{change.node_id[:12]} (epoch {change.epoch}; was replica {change.previous}); training went on"
            )
    if result.final is not None:
        print(f"held-out loss {result.final.loss:.4f}, held-out accuracy {result.final.accuracy:.2%}")
    if result.samples:  # the newest estimate: how many of the job's workers paid (docs/OBSERVABILITY.md)
        last = result.samples[-1]
        print(last.gradient_noise.describe(last.active_workers))
    print(f"model   {model}\nsummary {out / 'summary.json'}\ntargets {out / 'prometheus-targets.json'}")
