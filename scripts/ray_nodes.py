"""The same gemps job on a Ray cluster of 1 node and of 3 nodes, on this one machine: commits/s and
held-out accuracy over time (docs/RAY.md).

Both clusters have the same logical CPUs in total (3), on the same physical cores: the 3-node one
has three raylets and three object stores instead of one, and Ray must place the partitions on
distinct nodes (SPREAD, while they have room) instead of packing them. What this measures is what Ray's
multi-node machinery costs here, not what more machines would buy (docs/RAY.md's cost model does
that).

    .venv/bin/python scripts/ray_nodes.py --out docs/results/ray-nodes.json --figure docs/results/ray-nodes.png

With --replot RUNS.json it measures nothing: it reads recorded runs, prints each run's figures
again from its samples, and draws the figure (how tests/unit/test_ray_nodes_script.py runs it).

With --node-loss VERSION it measures a fault instead (docs/RAY.md's fault table): the same job on
a head with no CPUs and 3 nodes of 1 CPU, run without a fault and with the node that holds
workers and no partition lost once partition 0 reaches VERSION, alternating:

    .venv/bin/python scripts/ray_nodes.py --node-loss 120 --workers 4 --epochs 8 --out docs/results/ray-node-loss.json

With --lose-partition INDEX as well, the node lost is partition INDEX's (it moves to another node
from its newest checkpoint; the workers follow):

    .venv/bin/python scripts/ray_nodes.py --node-loss 120 --lose-partition 1 --workers 4 --epochs 8 \
        --out docs/results/ray-partition-node-loss.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Every node's address as Ray gives it to actors is then loopback (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

if TYPE_CHECKING:  # Ray is imported where a run measures, so --replot starts without it
    from gemps_worker.on_ray import RayJobOptions

TOTAL_CPUS = 3
SLICE = 0.25


def one_run(nodes: int, options: RayJobOptions) -> dict[str, Any]:
    from gemps_worker.on_ray import run_job
    from gemps_worker.on_ray.local import local_cluster

    with local_cluster(nodes, TOTAL_CPUS / nodes):
        started = time.time()
        result = run_job(options)
    return {
        "nodes": nodes,
        "started": started,
        "seconds": result.seconds,
        "partition_nodes": len({endpoint.node_id for endpoint in result.partitions}),
        "final": None if result.final is None else asdict(result.final),
        "samples": [asdict(sample) for sample in result.samples],
        "evaluations": [asdict(evaluation) for evaluation in result.evaluations],
    }


def node_loss_run(version: int | None, options: RayJobOptions, partition: int | None = None) -> dict[str, Any]:
    """One run on a head with no CPUs and 3 nodes of 1 CPU: without a fault (`version` None), or
    losing the node of the most workers and no partition (or partition `partition`'s) once
    partition 0 reaches `version`. Seconds after the loss: until Ray marked the node dead, the
    driver saw each lost actor's new life, a lost worker's first commit, partition 0's version
    moved again; and the commits a moved partition lost (its final version behind the other's)."""
    from gemps_server.checkpoint_files import load_latest
    from gemps_worker.on_ray import RayJob
    from gemps_worker.on_ray.faults import partition_name, worker_name
    from gemps_worker.on_ray.local import RemoveNode, local_cluster, resumed_after
    from gemps_worker.on_ray.run import follow_job

    with local_cluster(4, TOTAL_CPUS / 3, head_cpus=0) as cluster:
        started, clock = time.time(), time.monotonic()  # the job's seconds count from here, as run_job's
        with RayJob(options) as job:
            loss = None if version is None else RemoveNode(cluster, job, version, partition)
            result = follow_job(job, loss, clock)
    run: dict[str, Any] = {
        "node_loss_at": version,
        "started": started,
        "seconds": result.seconds,
        "final": None if result.final is None else asdict(result.final),
        "samples": [asdict(sample) for sample in result.samples],
        "evaluations": [asdict(evaluation) for evaluation in result.evaluations],
        "node_losses": [asdict(lost) for lost in result.node_losses],
        "restarts": [asdict(restart) for restart in result.restarts],
    }
    if loss is not None:
        lost = [worker_name(index) for index in loss.workers]
        lost += [] if partition is None else [partition_name(partition)]
        restarts = [restart for restart in result.restarts if restart.actor in lost]
        run["lost"] = {
            "workers": loss.workers,
            "partition": partition,
            "held": [list(lost.held) for lost in result.node_losses],
            "marked_dead_seconds": [lost.seen - loss.removed for lost in result.node_losses],
            "restart_seen_seconds": {restart.actor: restart.seen - loss.removed for restart in restarts},
            "first_commit_seconds": [result.outcomes[index].first_commit - loss.removed for index in loss.workers],
            "resumed_seconds": resumed_after(result.samples, loss.removed),
        }
        if partition is not None:  # the final checkpoints: the moved one is behind by what it lost
            folders = sorted(Path(options.work_dir).glob("partition-*"))
            versions = [found[1].version for found in map(load_latest, folders) if found]
            run["lost"]["final_versions"] = versions
            run["lost"]["acknowledged_lost"] = versions[1 - partition] - versions[partition]
    return run


def figures(run: dict[str, Any]) -> dict[str, float | None]:
    """A run's phases: Ray's start-up (to the first commit), training, time to the demo's bar."""
    samples, started = run["samples"], run["started"]
    moving = [s for s in samples if s["version"] > 0]
    first, last = (moving[0], moving[-1]) if moving else (None, None)
    bar = next((e for e in run["evaluations"] if e["accuracy"] >= 0.9), None)
    training = None if first is None or last is None else last["time"] - first["time"]
    return {
        "first_commit_seconds": None if first is None else first["time"] - started,
        "training_seconds": training,
        "commits_per_second": None if not training or last is None else last["version"] / training,
        "bar_seconds": None if bar is None else bar["time"] - started,
        "final_accuracy": None if run["final"] is None else run["final"]["accuracy"],
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate, accuracy) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {1: "tab:blue", 3: "tab:orange"}
    for run in runs:
        label = f"{run['nodes']} node{'s' if run['nodes'] > 1 else ''}, run {run['repeat'] + 1}"
        style = {"color": colors.get(run["nodes"]), "linestyle": "-" if run["repeat"] == 0 else "--"}
        samples = run["samples"]
        times = [s["time"] - run["started"] for s in samples]
        rates = [(b["version"] - a["version"]) / (b["time"] - a["time"]) for a, b in itertools.pairwise(samples)]
        rate.plot(times[1:], rates, label=label, **style)
        evaluations = run["evaluations"]
        seconds = [e["time"] - run["started"] for e in evaluations]
        accuracy.plot(seconds, [e["accuracy"] for e in evaluations], label=label, **style)
    rate.set(xlabel="seconds since the job started", ylabel="commits/s (partition 0)", title="commits per second")
    accuracy.set(xlabel="seconds since the job started", ylabel="held-out accuracy", title="held-out accuracy")
    accuracy.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    for axes in (rate, accuracy):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.suptitle("gemps ray: 2 partitions, 8 workers, digits-cnn; one machine (2 cores) either way")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/results/ray-nodes.json")
    parser.add_argument("--figure", default="docs/results/ray-nodes.png")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating 1, 3, 1, 3, ...")
    parser.add_argument(
        "--node-loss", type=int, default=0, metavar="VERSION", help="measure a lost worker node instead (above)"
    )
    parser.add_argument(
        "--lose-partition", type=int, default=None, metavar="INDEX", help="with --node-loss: partition INDEX's node"
    )
    parser.add_argument("--replot", type=Path, default=None, metavar="RUNS", help="draw recorded runs again (above)")
    args = parser.parse_args()
    if args.replot is not None:
        return replot(args.replot, Path(args.figure))
    if args.node_loss:
        return measure_node_loss(args)
    from gemps_worker.on_ray import RayJobOptions

    runs = []
    for repeat in range(args.repeats):
        for nodes in (1, 3):
            with tempfile.TemporaryDirectory(prefix="gemps-ray-nodes-") as folder:
                options = RayJobOptions(
                    partitions=2, workers=args.workers, epochs=args.epochs, interval=0.5, work_dir=folder,
                    out=folder, partition_cpus=SLICE, worker_cpus=SLICE, evaluator_cpus=SLICE,
                )  # fmt: skip
                run = {**one_run(nodes, options), "repeat": repeat}
            run["figures"] = figures(run)
            runs.append(run)
            print(f"{nodes} node(s), run {repeat + 1}: {json.dumps(run['figures'])}", flush=True)
    Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")
    plot(runs, Path(args.figure))
    return 0


def replot(recorded: Path, figure: Path) -> int:
    runs = json.loads(recorded.read_text())
    for run in runs:
        print(f"{run['nodes']} node(s), run {run['repeat'] + 1}: {json.dumps(figures(run))}", flush=True)
    plot(runs, figure)
    return 0


def measure_node_loss(args: argparse.Namespace) -> int:
    from gemps_worker.on_ray import RayJobOptions

    runs = []
    for repeat in range(args.repeats):
        for version in (None, args.node_loss):
            with tempfile.TemporaryDirectory(prefix="gemps-ray-node-loss-") as folder:
                options = RayJobOptions(
                    partitions=2, workers=args.workers, epochs=args.epochs, interval=0.5, work_dir=folder,
                    out=folder, partition_cpus=SLICE, worker_cpus=SLICE, evaluator_cpus=SLICE,
                )  # fmt: skip
                run = {**node_loss_run(version, options, args.lose_partition), "repeat": repeat}
            run["figures"] = figures(run)
            runs.append(run)
            print(
                f"node loss at {version}, run {repeat + 1}: {json.dumps(run['figures'])} {run.get('lost')}", flush=True
            )
    Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
