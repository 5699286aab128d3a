"""`gemps experiment`: the GEM paper's comparisons with the real server; curves, figures, RESULTS.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemps_worker.experiment.suite import full_suite, quick_suite
from gemps_worker.experiment.suite_runner import run_suite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the GEM paper's comparisons with the real server (resumable) and write curves, figures and RESULTS.md."
    )
    parser.add_argument("--suite", choices=("full", "quick"), default="full", help="which runs (default full)")
    parser.add_argument("--runs", nargs="*", default=None, help="only these run names (see --list)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per worker in the full suite (default 10)")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/experiment"), help="raw results (default runs/experiment)"
    )
    parser.add_argument("--report", type=Path, default=None, help="report folder (default: OUT/report)")
    parser.add_argument("--force", action="store_true", help="rerun runs that already have results")
    parser.add_argument("--list", action="store_true", help="list the suite's runs and exit")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="where RESULTS.md goes (default: REPORT/RESULTS.md)"
    )
    parser.add_argument("--discussion", type=Path, default=None, help="markdown appended to RESULTS.md")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    suite = full_suite(args.epochs) if args.suite == "full" else quick_suite()
    if args.runs:
        unknown = set(args.runs) - {c.name for c in suite}
        if unknown:
            print(f"gemps experiment: unknown runs {sorted(unknown)}; see --list", file=sys.stderr)
            return 2
        suite = [c for c in suite if c.name in args.runs]
    if args.list:
        for c in suite:
            t = c.training
            print(
                f"{c.name:28s} rule={t.rule} workers={c.workers} eta={t.learning_rate:g} kappa={t.kappa:g} "
                f"mode={t.worker_mode} epochs={c.epochs}"
            )
        return 0
    report = args.report or args.out / "report"
    discussion = args.discussion.read_text() if args.discussion and args.discussion.exists() else ""
    command = "gemps experiment " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["experiment"] else "gemps experiment"
    return run_suite(
        suite, args.out, report, args.markdown or report / "RESULTS.md", discussion, args.force, command.strip()
    )
