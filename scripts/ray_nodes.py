"""The same gemps job on a Ray cluster of 1 node and of 3 nodes, on this one machine: commits/s and
held-out accuracy over time (docs/RAY.md).

Both clusters have the same logical CPUs in total (3), on the same physical cores: the 3-node one
has three raylets and three object stores instead of one, and Ray must place the partitions on
distinct nodes (STRICT_SPREAD) instead of packing them. What this measures is what Ray's
multi-node machinery costs here, not what more machines would buy (docs/RAY.md's cost model does
that).

    .venv/bin/python scripts/ray_nodes.py --out docs/results/ray-nodes.json --figure docs/results/ray-nodes.png
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
from typing import Any

# Every node's address as Ray gives it to actors is then loopback (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from gemps_worker.on_ray import RayJobOptions, run_job
from gemps_worker.on_ray.local import local_cluster

TOTAL_CPUS = 3
SLICE = 0.25


def one_run(nodes: int, options: RayJobOptions) -> dict[str, Any]:
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    raise SystemExit(main())
