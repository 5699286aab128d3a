"""`gemps bench`: gemps against the transport and memory ceilings and peer parameter servers."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemps_bench.main import DESCRIPTION, run_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds per cell: checks the harness (CI)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for results.json and tables")
    parser.add_argument("--figure", type=Path, default=None, help="write the plot here (default OUT/performance.png)")
    parser.add_argument("--report-only", action="store_true", help="rebuild tables and figure from OUT/results.json")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return run_bench(args.out, args.figure, quick=args.quick, report_only=args.report_only)
