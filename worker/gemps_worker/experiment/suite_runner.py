"""Run a suite of configurations (resumable: finished runs are reused) and write the report."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from gemps_worker.experiment.analysis import summarize
from gemps_worker.experiment.report import (
    draw_figures,
    proxy_checks,
    write_curves,
    write_results_markdown,
    write_summaries,
)
from gemps_worker.experiment.runner import RunConfig, RunResult, run

log = logging.getLogger("gemps.experiment")


def run_suite(
    suite: Sequence[RunConfig],
    out: Path,
    report: Path,
    markdown: Path,
    discussion: str = "",
    force: bool = False,
    command: str = "gemps experiment",
) -> int:
    """Run (or reuse from `out`) every configuration, then write the report and RESULTS.md."""
    results: list[RunResult] = []
    for i, config in enumerate(suite, 1):
        saved = out / config.name / "result.json"
        if saved.exists() and not force:
            result = RunResult.load(saved)
            print(f"[{i}/{len(suite)}] {config.name}: reusing {saved}", flush=True)
        else:
            print(
                f"[{i}/{len(suite)}] {config.name}: {config.workers} workers x {config.epochs} epochs ...", flush=True
            )
            result = run(config, out / config.name)
        s = summarize(result)
        print(
            f"    {s.commits} commits in {s.wall_seconds:.0f}s, final training loss {s.final_training_loss:.4f}, "
            f"held-out accuracy {100 * s.held_out_accuracy:.2f}%, median pi {s.median_pi:.3f}, "
            f"diverged workers {s.diverged_workers}",
            flush=True,
        )
        results.append(result)
    report.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in results]
    write_curves(results, report)
    write_summaries(summaries, report)
    drawn = draw_figures(results, report)
    checks = proxy_checks(summaries)
    write_results_markdown(markdown, summaries, checks, drawn, command, discussion)
    for check in checks:
        print(f"{'met' if check.passed else 'NOT met'}: {check.claim} ({check.detail})")
    print(f"report: {markdown}")
    return 0
