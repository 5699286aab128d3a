"""`gemps plan` against `gemps bench` (issue 79, item 3): for every gemps cell of a bench run, the
commits/s and server memory the planner projects for that cell (its size, clients, rule, encoding,
partitions; workers that only commit, on this host's cores) beside what the bench measured.

The costs come from `--calibration` (other bench runs' results.json files: an out-of-sample check, or
a calibration of another day), or
by default from the planner's own calibration (gemps_bench.measured_costs). Prints a table and,
with --json, writes the rows; exits 1 when a row is off by more than --tolerance (default 25 %).
A results file of `gemps bench --link RATE` (cross-host.json) is projected on its links, where a
plan is a range: from the workers' transfers in step (every commit's bytes up, then every reply's
down, each sharing the links) to staggered (each at the link's full rate). Such a row is judged by
the range: off by nothing inside it, else by its nearer end.

`--refit` writes gemps_bench/measured_costs.py again from the runs it records (after a new run is
recorded there, or the fit changes), and checks nothing.

    .venv/bin/gemps bench --sizes 1M,10M,100M --clients 2 --systems gemps,gemps-downpour,gemps-4p --out runs/b
    .venv/bin/python scripts/plan_check.py runs/b/results.json --json docs/results/plan/check.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from gemps_bench.capacity import Calibration, Curve, Job, PathCost, fit, path_of, plan
from gemps_bench.measured_costs import MEASURED, RECORDED_RUNS

ROOT = Path(__file__).resolve().parents[1]
COSTS_MODULE = ROOT / "benchmarks" / "gemps_bench" / "measured_costs.py"


def rows(
    runs: list[dict[str, Any]],
    calibration: Calibration,
    cores: int,
    link: float | None = None,
    clients_link: float | None = None,
) -> list[dict[str, Any]]:
    checked = []
    for run in runs:
        path = path_of(run)  # the cells the calibration can use are the cells it can project
        if path is None:
            continue
        rule, encoding = path.removesuffix("+tcp").split("/")
        job = Job(
            parameters=run["num_parameters"], workers=run["clients"], rule=rule, encoding=encoding,
            partitions=int(run.get("partitions") or 1),
            local_steps=1, host_cores=cores, shared_memory=bool(run.get("shared_memory", True)),
            link_bytes_per_second=link, worker_link_bytes_per_second=clients_link,
        )  # fmt: skip
        projected = plan(job, calibration)
        row = {"system": run["system"], "parameters": run["num_parameters"], "clients": run["clients"]}
        row |= {"partitions": job.partitions}
        row |= {"commits_per_s": run["commits_per_second"], "projected_commits_per_s": projected.commits_per_s}
        row |= {"projected_commits_per_s_in_step": projected.commits_per_s_in_step}
        row |= {"server_memory_bytes": run["server_peak_rss_bytes"]}
        row |= {"projected_server_memory_bytes": projected.server_memory_bytes, "limited_by": projected.limited_by}
        checked.append(row | {"path": projected.path})
    return checked


def coded_by_numpy(run: dict[str, Any]) -> bool:
    """Whether a run's codes went through the codec's numpy passes, at 3-7x the CPU of the compiled
    ones the default calibration's were (docs/guides/sizing.md): its `codes` says (gemps_bench.suite.CODES),
    and runs recorded before 2026-12-05 say nothing, so theirs were numpy's."""
    return str(run.get("compression", "none")) != "none" and run.get("codes") != "compiled"


def ratio_to_range(low: float, high: float) -> float:
    """A projected range's ratio to the measured, given as the ratios of its ends: 1 where the
    measured lies within it, else the nearer end's."""
    low, high = min(low, high), max(low, high)
    return 1.0 if low <= 1.0 <= high else (low if low > 1.0 else high)


def costs_module(calibration: Calibration) -> str:
    """gemps_bench/measured_costs.py's text for `calibration` (before ruff formats it)."""
    module = COSTS_MODULE.read_text()
    head = module[: module.index("MEASURED = Calibration(")]

    def curve(found: Curve | None) -> str:
        return "None" if found is None else f"Curve({tuple((float(x), float(y)) for x, y in found.points)!r})"

    paths = "".join(
        f"    {name!r}: PathCost({', '.join(curve(getattr(cost, field.name)) for field in fields(PathCost))}),\n"
        for name, cost in sorted(calibration.paths.items())
    )
    return f"{head}MEASURED = Calibration(\n  {{\n{paths}  }},\n  {calibration.source!r},\n)\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "results",
        type=Path,
        nargs="?",
        help="a `gemps bench` results.json or cross-host.json: the measurements checked",
    )
    parser.add_argument(
        "--calibration", type=Path, nargs="+", default=None,
        help="the results.json files the costs are fitted from (default: the planner's own calibration)",
    )  # fmt: skip
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the bench host's cores")
    parser.add_argument("--tolerance", type=float, default=0.25)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--refit", action="store_true", help="write the default calibration from its recorded runs")
    args = parser.parse_args()
    if args.refit:
        runs = [run for path in RECORDED_RUNS for run in json.loads((ROOT / path).read_text())["runs"]]
        COSTS_MODULE.write_text(costs_module(fit(runs, MEASURED.source)))
        subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", str(COSTS_MODULE)], check=True)
        print(f"wrote {COSTS_MODULE.relative_to(ROOT)} from {', '.join(RECORDED_RUNS)}")
        return 0
    if args.results is None:
        parser.error("give a results.json to check, or --refit")
    calibration = MEASURED
    if args.calibration is not None:
        runs = [run for path in args.calibration for run in json.loads(path.read_text())["runs"]]
        calibration = fit(runs, ", ".join(str(path) for path in args.calibration))
    measured = json.loads(args.results.read_text())
    links = (measured.get("link_bytes_per_second"), measured.get("clients_link_bytes_per_second"))
    checked = rows(measured["runs"], calibration, args.cores, *links)
    worst = 0.0
    between_hosts = links[0] is not None
    columns = ("commits/s", "projected", "ratio", "in step", "ratio", "memory MB", "projected", "ratio")
    print(f"{'system':>18} {'K':>2} {'P':>11} {'n':>2} " + " ".join(f"{column:>9}" for column in columns))
    for row in checked:
        speed = row["projected_commits_per_s"] / row["commits_per_s"]
        in_step = row["projected_commits_per_s_in_step"] / row["commits_per_s"]
        memory = row["projected_server_memory_bytes"] / row["server_memory_bytes"]
        row["commits_ratio"], row["commits_ratio_in_step"], row["memory_ratio"] = speed, in_step, memory
        row["commits_ratio_to_range"] = ratio_to_range(in_step, speed)
        judged = row["commits_ratio_to_range"] if between_hosts else speed
        worst = max(worst, abs(judged - 1), abs(memory - 1))
        figures = (
            row["commits_per_s"], row["projected_commits_per_s"], speed, row["projected_commits_per_s_in_step"],
            in_step, row["server_memory_bytes"] / 1e6, row["projected_server_memory_bytes"] / 1e6, memory,
        )  # fmt: skip
        print(
            f"{row['system']:>18} {row['partitions']:>2} {row['parameters']:>11,} {row['clients']:>2} "
            + " ".join(f"{figure:>9.2f}" for figure in figures)
        )
    numpy_codes = sum(coded_by_numpy(run) for run in measured["runs"] if path_of(run) is not None)
    if numpy_codes and args.calibration is None:
        print(f"{numpy_codes} cells of codes through the codec's numpy passes: the default calibration's are compiled")
    judged = "the range from in step to staggered" if between_hosts else "the projection"
    print(f"worst: {worst:.0%} off by {judged} (tolerance {args.tolerance:.0%}); costs from {calibration.source}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"calibration": calibration.source, "measured": str(args.results), "rows": checked, "worst": worst}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
