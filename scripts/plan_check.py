"""`gemps plan` against `gemps bench` (issue 79, item 3): for every gemps cell of a bench run, the
commits/s and server memory the planner projects for that cell (its size, clients, rule, encoding,
partitions; workers that only commit, on this host's cores) beside what the bench measured.

The costs come from `--calibration` (another bench run's results.json: an out-of-sample check), or
by default from the planner's own calibration (gemps_bench.measured_costs). Prints a table and,
with --json, writes the rows; exits 1 when a row is off by more than --tolerance (default 25 %).

    .venv/bin/gemps bench --sizes 1M,10M,100M --clients 2 --systems gemps,gemps-downpour,gemps-4p --out runs/b
    .venv/bin/python scripts/plan_check.py runs/b/results.json --json docs/results/plan/check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gemps_bench.capacity import Calibration, Job, fit, path_of, plan
from gemps_bench.measured_costs import MEASURED


def rows(runs: list[dict[str, Any]], calibration: Calibration, cores: int) -> list[dict[str, Any]]:
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
        )  # fmt: skip
        projected = plan(job, calibration)
        row = {"system": run["system"], "parameters": run["num_parameters"], "clients": run["clients"]}
        row |= {"commits_per_s": run["commits_per_second"], "projected_commits_per_s": projected.commits_per_s}
        row |= {"server_memory_bytes": run["server_peak_rss_bytes"]}
        row |= {"projected_server_memory_bytes": projected.server_memory_bytes, "limited_by": projected.limited_by}
        checked.append(row | {"path": projected.path})
    return checked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a `gemps bench` results.json: the measurements checked")
    parser.add_argument("--calibration", type=Path, default=None, help="the results.json the costs are fitted from")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the bench host's cores")
    parser.add_argument("--tolerance", type=float, default=0.25)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    calibration = MEASURED
    if args.calibration is not None:
        calibration = fit(json.loads(args.calibration.read_text())["runs"], str(args.calibration))
    checked = rows(json.loads(args.results.read_text())["runs"], calibration, args.cores)
    worst = 0.0
    columns = ("commits/s", "projected", "ratio", "memory MB", "projected", "ratio")
    print(f"{'system':>15} {'P':>11} {'n':>2} " + " ".join(f"{column:>10}" for column in columns))
    for row in checked:
        speed = row["projected_commits_per_s"] / row["commits_per_s"]
        memory = row["projected_server_memory_bytes"] / row["server_memory_bytes"]
        row["commits_ratio"], row["memory_ratio"] = speed, memory
        worst = max(worst, abs(speed - 1), abs(memory - 1))
        print(
            f"{row['system']:>15} {row['parameters']:>11,} {row['clients']:>2} {row['commits_per_s']:>10.2f} "
            f"{row['projected_commits_per_s']:>10.2f} {speed:>10.2f} {row['server_memory_bytes'] / 1e6:>10.0f} "
            f"{row['projected_server_memory_bytes'] / 1e6:>10.0f} {memory:>10.2f}"
        )
    print(f"worst: {worst:.0%} off (tolerance {args.tolerance:.0%}); costs from {calibration.source}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"calibration": calibration.source, "measured": str(args.results), "rows": checked, "worst": worst}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
