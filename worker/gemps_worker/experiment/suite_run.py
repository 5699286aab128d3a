"""Run a suite of configurations (resumable: finished runs are reused) and write the report."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from gemps_worker.experiment.analysis import aggregates, summarize
from gemps_worker.experiment.on_links import LOCAL, ServerPlacement
from gemps_worker.experiment.report import (
    describe_setting,
    draw_figures,
    proxy_checks,
    write_aggregates,
    write_curves,
    write_results_markdown,
    write_summaries,
)
from gemps_worker.experiment.single_run import RunConfig, RunResult, run

log = logging.getLogger("gemps.experiment")


def run_suite(
    suite: Sequence[RunConfig],
    out: Path,
    report: Path,
    markdown: Path,
    discussion: str = "",
    force: bool = False,
    command: str = "gemps experiment",
    placement: ServerPlacement = LOCAL,
) -> int:
    """Run (or reuse from `out`) every configuration, its server where `placement` says, then write
    the report and RESULTS.md."""
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
            result = run(config, out / config.name, placement=placement)
        s = summarize(result)
        print(
            f"    {s.commits} commits in {s.wall_seconds:.0f}s, final training loss {s.final_training_loss:.4f} "
            f"(full training set {s.final_train_loss_full:.4f}), held-out accuracy {100 * s.held_out_accuracy:.2f}%, "
            f"median pi {s.median_pi:.3f}, {s.bytes_moved:.1f} MB moved, diverged workers {s.diverged_workers}",
            flush=True,
        )
        results.append(result)
    report.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in results]
    write_curves(results, report)
    write_summaries(summaries, report)
    found = aggregates(summaries)
    write_aggregates(found, report)
    for a in found:
        print(
            f"{a.name}: {a.runs} seeds, held-out accuracy {100 * a.mean['held_out_accuracy']:.2f}% "
            f"± {100 * a.sd['held_out_accuracy']:.2f}, full-train loss {a.mean['final_train_loss_full']:.4f} "
            f"± {a.sd['final_train_loss_full']:.4f}"
        )
    drawn = draw_figures(results, report)
    checks = proxy_checks(summaries)
    settings = {r.config.name: describe_setting(r.config) for r in results}
    write_results_markdown(markdown, summaries, checks, drawn, command, discussion, settings)
    for check in checks:
        print(f"{'met' if check.passed else 'NOT met'}: {check.claim} ({check.detail})")
    print(f"report: {markdown}")
    return 0
