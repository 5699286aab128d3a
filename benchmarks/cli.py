"""`gemps bench` / `python -m benchmarks`: run the suite, write the JSON, the figure and the report tables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import report
from benchmarks.suite import FULL, QUICK, run_suite

DESCRIPTION = (
    "Benchmark gemps against the gRPC transport ceiling, the memory-bandwidth ceiling and peer parameter servers "
    "(torch.distributed.rpc, the GEM reference code's transport), all in one run. The full suite takes about 20 "
    "minutes on 2 cores; docs/PERFORMANCE.md explains every figure."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`gemps bench`'s flags (the CLI builds its parser lazily, see gemps.cli)."""
    parser.description = DESCRIPTION
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds per cell: checks the harness (CI)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for results.json and tables")
    parser.add_argument("--figure", type=Path, default=None, help="write the plot here (default OUT/performance.png)")
    parser.add_argument("--report-only", action="store_true", help="rebuild tables and figure from OUT/results.json")
    parser.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    results_path = args.out / "results.json"
    if not args.report_only:
        run_suite(QUICK if args.quick else FULL, "quick" if args.quick else "full", results_path)
    data = json.loads(results_path.read_text())
    tables = args.out / "tables.md"
    sections = [
        "## Targets",
        *report.targets(data),
        "",
        "## gemps against the ceilings and peers",
        *report.throughput_table(data),
        "",
        "## Every run",
        *report.systems_table(data),
    ]
    if data["skipped"]:
        sections += [
            "",
            "## Skipped",
            *[f"- {s['system']} P={s['num_parameters']:,} n={s['clients']}: {s['why']}" for s in data["skipped"]],
        ]
    tables.write_text("\n".join(sections) + "\n")
    report.figure(data, args.figure or args.out / "performance.png")
    print(f"results: {results_path}\ntables: {tables}")
    return 0


def _skipped_line(skip: dict[str, object]) -> str:
    return f"- {skip['system']} P={skip['num_parameters']:,} n={skip['clients']}: {skip['why']}"
