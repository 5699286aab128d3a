"""Writes an experiment's curves (CSV), summaries (CSV/JSON), figures (PNG) and RESULTS.md."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from gemps_worker.experiment import figures
from gemps_worker.experiment.analysis import CURVE_FIELDS, Check, Summary, by_name, compare_to_proxy, step_curve
from gemps_worker.experiment.runner import RunResult
from gemps_worker.experiment.suite import ETA_WORKERS, MISSPECIFIED_ETA, REFERENCE_WORKERS


def write_curves(results: Sequence[RunResult], folder: Path) -> None:
    (folder / "curves").mkdir(parents=True, exist_ok=True)
    for result in results:
        curve = step_curve(result)
        with open(folder / "curves" / f"{result.config.name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["worker_step", "workers_at_step", *CURVE_FIELDS])
            for i, step in enumerate(curve.steps):
                writer.writerow(
                    [int(step), int(curve.workers_at_step[i]), *(f"{curve.values[k][i]:.6g}" for k in CURVE_FIELDS)]
                )
        with open(folder / "curves" / f"{result.config.name}-held-out.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["seconds", "version", "loss", "accuracy"])
            for h in result.held_out:
                writer.writerow([f"{h.time:.2f}", h.version, f"{h.loss:.6g}", f"{h.accuracy:.6g}"])


def write_summaries(summaries: Sequence[Summary], folder: Path) -> None:
    names = [f.name for f in fields(Summary)]
    with open(folder / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for s in summaries:
            writer.writerow(asdict(s))
    (folder / "summary.json").write_text(json.dumps([asdict(s) for s in summaries], indent=1))


def draw_figures(results: Sequence[RunResult], folder: Path) -> list[Path]:
    runs = {r.config.name: r for r in results}
    proxy = runs.get("momentum-n1")
    drawn: list[Path] = []
    if proxy is None:
        return drawn

    def series(rule: str) -> list[RunResult]:
        found = [
            r
            for name, r in runs.items()
            if r.config.training.rule == rule
            and r.config.training.worker_mode == "gradient"
            and name == f"{rule}-n{r.config.workers}"
        ]
        return sorted(found, key=lambda r: r.config.workers)

    gem = series("gem")
    if gem:
        drawn.append(figures.figure_1(folder / "fig1_gem_workers.png", gem, proxy))
        drawn.append(figures.figure_3(folder / "fig3_pi.png", gem))
    if series("downpour") and series("adaptive-staleness"):
        drawn.append(
            figures.figure_2(
                folder / "fig2_downpour_adaptive.png", series("downpour"), series("adaptive-staleness"), proxy
            )
        )
    eta = f"eta{MISSPECIFIED_ETA:g}"
    pairs = [
        (runs[f"gem-n{n}-{eta}"], runs[f"downpour-n{n}-{eta}"])
        for n in ETA_WORKERS
        if f"gem-n{n}-{eta}" in runs and f"downpour-n{n}-{eta}" in runs
    ]
    if pairs and f"momentum-n1-{eta}" in runs:
        drawn.append(figures.figure_6(folder / "fig6_eta.png", pairs, runs[f"momentum-n1-{eta}"]))
    n = REFERENCE_WORKERS
    kappas = [runs[k] for k in (f"gem-n{n}", *(f"gem-n{n}-kappa{k}" for k in (2, 3, 4))) if k in runs]
    if len(kappas) > 1:
        drawn.append(figures.figure_8(folder / "fig8_kappa.png", kappas, proxy))
    workers = max((r.config.workers for r in results if r.config.training.worker_mode != "gradient"), default=0)
    modes = [
        r
        for r in results
        if r.config.workers == workers
        and r.config.training.learning_rate == 0.05
        and r.config.training.kappa == 1.0
        and workers > 0
    ]
    if modes:
        drawn.append(figures.figure_modes(folder / "fig_methods.png", modes, proxy))
    return drawn


def proxy_checks(summaries: Sequence[Summary]) -> list[Check]:
    found = by_name(summaries)
    proxy = found.get("momentum-n1")
    if proxy is None:
        return []
    gem = sorted((s for s in summaries if s.name == f"gem-n{s.workers}"), key=lambda s: s.workers)
    return [compare_to_proxy(s, proxy) for s in gem]


def summary_table(summaries: Sequence[Summary]) -> str:
    header = (
        "| run | workers | eta | kappa | commits | steps/worker | final train loss | held-out loss | "
        "held-out acc | median pi (mean over commits) | mean pi | pi=0 | pi=max | mean staleness | diverged | wall s |"
    )
    lines = [header, "|" + "---|" * 16]
    for s in summaries:
        lines.append(
            f"| {s.name} | {s.workers} | {s.learning_rate:g} | {s.kappa:g} | {s.commits} | {s.worker_steps} | "
            f"{s.final_training_loss:.4f} | {s.held_out_loss:.4f} | {100 * s.held_out_accuracy:.2f}% | "
            f"{s.median_pi:.3f} | {s.mean_pi:.3f} | {s.fraction_pi_zero:.2f} | {s.fraction_pi_max:.2f} | "
            f"{s.mean_staleness:.1f} | {s.diverged_workers} | {s.wall_seconds:.0f} |"
        )
    return "\n".join(lines)


def write_results_markdown(
    path: Path,
    summaries: Sequence[Summary],
    checks: Sequence[Check],
    drawn: Sequence[Path],
    command: str,
    discussion: str,
) -> None:
    rel = [os.path.relpath(p, path.parent) for p in drawn]
    check_lines = [f"- {'met' if c.passed else 'NOT met'}: {c.claim} ({c.detail})" for c in checks]
    text = f"""# Results: GEM against asynchronous SGD, reproduced with the real service

Generated by `{command}` (the tables, checks and figures below; the discussion is written by hand).
Every run starts a real `gemps server` and real worker loops talking gRPC on this machine.

## Settings

Data: scikit-learn's handwritten digits (1,438 training / 359 held-out 8x8 images; MNIST cannot
be downloaded here). Model: `digits-cnn` (two 3x3 convolutions, 38,570 parameters). Every worker
runs over the whole training set in its own shuffled order (the paper's setting), batch 64, so
one epoch is 22 worker steps. Defaults: eta = 0.05, mu = 0.9, kappa = 1, pi_max = 5.
"Final training loss" averages the last 10% of worker steps of the per-step mean over workers
of each mini-batch's loss; held-out figures are for the final central variable. pi statistics
pool every commit after the first 10% of the run.

## Summary

{summary_table(summaries)}

## Checks against the momentum proxy (equal worker steps)

{chr(10).join(check_lines) or "- (no momentum proxy run in this suite)"}

## Figures

{chr(10).join(f"![{p}]({p})" for p in rel)}

{discussion}
"""
    path.write_text(text)
