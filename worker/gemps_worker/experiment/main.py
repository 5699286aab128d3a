"""`gemps experiment`: run a suite of configurations (resumable) and write the report."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gemps_worker.experiment.analysis import summarize
from gemps_worker.experiment.report import (
    draw_figures,
    proxy_checks,
    write_curves,
    write_results_markdown,
    write_summaries,
)
from gemps_worker.experiment.runner import RunResult, run
from gemps_worker.experiment.suite import SUITES

log = logging.getLogger("gemps.experiment")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=tuple(SUITES), default="full", help="which runs (default full)")
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
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    suite = SUITES[args.suite](args.epochs) if args.suite == "full" else SUITES[args.suite]()  # type: ignore[call-arg]
    if args.runs:
        unknown = set(args.runs) - {c.name for c in suite}
        if unknown:
            print(f"gemps experiment: unknown runs {sorted(unknown)}; see --list", file=sys.stderr)
            return 2
        suite = [c for c in suite if c.name in args.runs]
    if args.list:
        for c in suite:
            print(
                f"{c.name:28s} rule={c.rule} workers={c.workers} eta={c.learning_rate:g} kappa={c.kappa:g} "
                f"mode={c.mode} epochs={c.epochs}"
            )
        return 0
    results: list[RunResult] = []
    for i, config in enumerate(suite, 1):
        saved = args.out / config.name / "result.json"
        if saved.exists() and not args.force:
            result = RunResult.load(saved)
            print(f"[{i}/{len(suite)}] {config.name}: reusing {saved}", flush=True)
        else:
            print(
                f"[{i}/{len(suite)}] {config.name}: {config.workers} workers x {config.epochs} epochs ...", flush=True
            )
            result = run(config, args.out / config.name)
        s = summarize(result)
        print(
            f"    {s.commits} commits in {s.wall_seconds:.0f}s, final training loss {s.final_training_loss:.4f}, "
            f"held-out accuracy {100 * s.held_out_accuracy:.2f}%, median pi {s.median_pi:.3f}, "
            f"diverged workers {s.diverged_workers}",
            flush=True,
        )
        results.append(result)
    report = args.report or args.out / "report"
    report.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in results]
    write_curves(results, report)
    write_summaries(summaries, report)
    drawn = draw_figures(results, report)
    checks = proxy_checks(summaries)
    discussion = args.discussion.read_text() if args.discussion and args.discussion.exists() else ""
    command = (
        "gemps experiment " + " ".join(a for a in sys.argv[2:])
        if sys.argv[1:2] == ["experiment"]
        else "gemps experiment"
    )
    markdown = args.markdown or report / "RESULTS.md"
    write_results_markdown(markdown, summaries, checks, drawn, command, discussion)
    for check in checks:
        print(f"{'met' if check.passed else 'NOT met'}: {check.claim} ({check.detail})")
    print(f"report: {markdown}")
    return 0
