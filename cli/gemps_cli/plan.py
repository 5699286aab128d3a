"""`gemps plan`: what a job needs from gemps (partitions, local steps, server cores and memory) and
what it gets (commits/s, the share of a worker's time spent waiting), projected from measured
per-commit costs (gemps_bench.capacity; docs/PERFORMANCE.md, "The cost of a commit as the model
grows"). A projection, not a measurement: `gemps bench` measures."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gemps_bench.capacity import (
    ENCODING_BYTES,
    MAX_LOCAL_STEPS,
    MAX_PARTITIONS,
    ROUND_RULES,
    RULES,
    Job,
    Plan,
    fit,
    plan,
)
from gemps_bench.counts import parse_counts
from gemps_bench.measured_costs import MEASURED

from gemps_proto import compiled_codes
from gemps_worker.simulated_hosts import rate_bits_per_second

EPILOG = """examples:
  gemps plan --params 124M --workers 16 --step-seconds 0.5 --link 10gbit --rule downpour --encoding int8
  gemps plan --params 124M --workers 16 --step-seconds 0.5 --link 10gbit --rule adamw   # rounds of gradients
  gemps plan --params 1M --workers 8    # workers that only commit on this host: what `gemps bench` measures
  gemps plan --params 10M --workers 4 --calibration runs/bench/results.json --json"""
# The default calibration's int8 costs are the codec's compiled passes (a C compiler at install).
NUMPY_CODES = (
    "gemps plan: this install's int8 codes are numpy's (no C compiler when it was installed), which cost "
    "3-7x the CPU projected here; reinstall with a C compiler at hand, or measure this install with "
    "`gemps bench --sizes 1M,10M --clients 2 --systems gemps-int8,gemps-recipe-tcp --out DIR` and plan "
    "with --calibration DIR/results.json"
)


def _count(text: str) -> int:
    try:
        (value,) = parse_counts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def _rate(text: str) -> float:
    try:
        return rate_bits_per_second(text) / 8
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = EPILOG
    parser.add_argument("--params", type=_count, required=True, help="the model's parameters (e.g. 124M, 1.3G: K, M)")
    parser.add_argument("--workers", type=_count, required=True, help="worker processes committing")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="a worker's time per local step (default 0: only commits)"
    )
    parser.add_argument(
        "--link", type=_rate, default=None, metavar="RATE",
        help="every host's link (e.g. 10gbit): workers and partitions on hosts of their own; "
        "default: all on this host over loopback, as `gemps bench` runs",
    )  # fmt: skip
    parser.add_argument(
        "--worker-link", type=_rate, default=None, metavar="RATE",
        help="with --link: a worker's host's link, where it differs from the partitions' (default: --link)",
    )  # fmt: skip
    parser.add_argument(
        "--rule", choices=RULES, default="gem",
        help="the server's rule and GEM state (default gem); adamw: rounds, every worker in step",
    )  # fmt: skip
    parser.add_argument(
        "--encoding", choices=tuple(ENCODING_BYTES), default="float32", help="a commit's values, both ways"
    )
    parser.add_argument(
        "--partitions", type=int, default=None, help=f"use K partitions (default: the fewest, up to {MAX_PARTITIONS})"
    )
    parser.add_argument(
        "--local-steps", type=int, default=None,
        help=f"steps per commit (default: the fewest that keep a worker's wait under 10 %%, up to {MAX_LOCAL_STEPS}; "
        "under --rule adamw 1, a gradient a commit: H plans rounds of H-step windows, the server's --outer-rate)",
    )  # fmt: skip
    parser.add_argument(
        "--host-cores",
        type=int,
        default=os.cpu_count() or 1,
        help="without --link: the host's cores (default: this one's)",
    )
    parser.add_argument(
        "--calibration", type=Path, default=None,
        help="a `gemps bench` results.json to fit the costs from (default: the project's measured run)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        calibration = MEASURED
        if args.calibration is not None:
            calibration = fit(_runs(args.calibration), str(args.calibration))
        job = Job(
            parameters=args.params, workers=args.workers, step_seconds=args.step_seconds,
            link_bytes_per_second=args.link, worker_link_bytes_per_second=args.worker_link, rule=args.rule,
            encoding=args.encoding, partitions=args.partitions, local_steps=args.local_steps,
            host_cores=args.host_cores,
        )  # fmt: skip
        result = plan(job, calibration)
    except (OSError, ValueError) as error:
        print(f"gemps plan: {error}", file=sys.stderr)
        return 2
    except KeyError as missing:  # only a calibration's runs are read by key
        print(f"gemps plan: --calibration {args.calibration}: a run has no field {missing}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json(), indent=1) if args.json else describe(job, result))
    if args.calibration is None and job.encoding == "int8" and compiled_codes.compiled is None:
        print(NUMPY_CODES, file=sys.stderr)
    return 0


def _runs(path: Path) -> list[dict[str, object]]:
    """The bench runs of `path`, a `gemps bench` results.json; ValueError naming it otherwise."""
    try:
        runs = json.loads(path.read_text())["runs"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"--calibration {path} is not a `gemps bench` results.json (no list of runs)") from None
    if not isinstance(runs, list):
        raise ValueError(f"--calibration {path} is not a `gemps bench` results.json (its runs are no list)")
    return runs


def describe(job: Job, result: Plan) -> str:
    where = "on one host over loopback" if job.link_bytes_per_second is None else (
        f"on hosts linked at {job.link_bytes_per_second * 8 / 1e9:g} Gbit/s"
    )  # fmt: skip
    parts = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in result.seconds_per_commit.items())
    return "\n".join(
        [
            f"{job.parameters:,} parameters, {job.workers} workers {where}, rule {job.rule}, {job.encoding} both ways",
            f"  partitions        {result.partitions} (a server core each)",
            f"  local steps       {result.local_steps} per commit" + _rounds(job, result),
            f"  server memory     {result.server_memory_bytes / 2**30:.2f} GiB in all",
            f"  commits/s         {result.commits_per_s:.1f} (limited by {result.limited_by})" + _in_step(result),
            f"  waiting           {result.waiting_share:.0%} of a worker's time",
            f"  a commit          {result.commit_bytes / 2**20:.1f} MiB each way; {parts}",
            f"projected from {result.path} costs measured in {result.calibration}" + _nearest(job, result),
        ]
    )


def _rounds(job: Job, result: Plan) -> str:
    if job.rule not in ROUND_RULES:
        return ""
    step = result.seconds_per_commit["round step"]
    return (
        f"\n  a round           {job.workers} commits in step, then the round's step ({step * 1e3:.1f} ms on the"
        f" busiest partition): {job.workers / result.commits_per_s:.3f} s"
    )


def _in_step(result: Plan) -> str:
    if result.commits_per_s_in_step >= result.commits_per_s:
        return ""
    return (
        f"; {result.commits_per_s_in_step:.1f} where the workers' transfers fall into step: between hosts"
        " expect a figure between the two (which end holds depends on how the commits fall)"
    )


def _nearest(job: Job, result: Plan) -> str:
    own = f"{job.rule}/{job.encoding}" + ("" if job.link_bytes_per_second is None else "+tcp")
    return "" if result.path == own else f" ({own} was not measured: the nearest path's)"
