"""Writes an experiment's curves (CSV), summaries (CSV/JSON), figures (PNG) and RESULTS.md."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from gemps_worker.experiment import paper_figures
from gemps_worker.experiment.analysis import (
    CURVE_FIELDS,
    TARGET_ACCURACY,
    Aggregate,
    Check,
    Summary,
    aggregate,
    aggregates,
    base_name,
    compare_to_proxy,
    group_by_config,
    step_curve,
)
from gemps_worker.experiment.single_run import RunConfig, RunResult
from gemps_worker.experiment.suite import ETA_WORKERS, MISSPECIFIED_ETA, REFERENCE_WORKERS

_COMPARISON = re.compile(r"^cmp-(?P<method>.+)-n(?P<workers>\d+)$")


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


def write_aggregates(found: Sequence[Aggregate], folder: Path) -> None:
    """summary_by_config.json: mean and sample sd over seeds of each configuration run >= 2 times."""
    (folder / "summary_by_config.json").write_text(json.dumps([asdict(a) for a in found], indent=1))


def comparison_figures(results: Sequence[RunResult], folder: Path) -> list[Path]:
    """One figure per worker count of the cmp-* runs (the agn suite), seeds pooled per method."""
    by_workers: dict[int, dict[str, list[RunResult]]] = {}
    for r in results:
        match = _COMPARISON.match(base_name(r.config.name))
        if match is not None:
            methods = by_workers.setdefault(int(match["workers"]), {})
            methods.setdefault(match["method"], []).append(r)
    return [
        paper_figures.figure_comparison(folder / f"fig_compare_n{n}.png", n, list(methods.items()))
        for n, methods in sorted(by_workers.items())
    ]


def draw_figures(results: Sequence[RunResult], folder: Path) -> list[Path]:
    drawn = comparison_figures(results, folder)
    runs = {r.config.name: r for r in results}
    proxy = runs.get("momentum-n1")
    if proxy is None:
        return drawn

    def series(rule: str) -> list[RunResult]:
        found = [
            r
            for name, r in runs.items()
            if r.config.training.rule == rule and r.config.mode == "gradient" and name == f"{rule}-n{r.config.workers}"
        ]
        return sorted(found, key=lambda r: r.config.workers)

    gem = series("gem")
    if gem:
        drawn.append(paper_figures.figure_1(folder / "fig1_gem_workers.png", gem, proxy))
        drawn.append(paper_figures.figure_3(folder / "fig3_pi.png", gem))
    if series("downpour") and series("adaptive-staleness"):
        drawn.append(
            paper_figures.figure_2(
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
        drawn.append(paper_figures.figure_6(folder / "fig6_eta.png", pairs, runs[f"momentum-n1-{eta}"]))
    n = REFERENCE_WORKERS
    kappas = [runs[k] for k in (f"gem-n{n}", *(f"gem-n{n}-kappa{k}" for k in (2, 3, 4))) if k in runs]
    if len(kappas) > 1:
        drawn.append(paper_figures.figure_8(folder / "fig8_kappa.png", kappas, proxy))
    workers = max((r.config.workers for r in results if r.config.mode != "gradient"), default=0)
    modes = [
        r
        for r in results
        if r.config.workers == workers
        and r.config.seed == 0
        and r.config.training.learning_rate == 0.05
        and r.config.kappa == 1.0
        and workers > 0
    ]
    if modes:
        drawn.append(paper_figures.figure_modes(folder / "fig_methods.png", modes, proxy))
    return drawn


def proxy_checks(summaries: Sequence[Summary]) -> list[Check]:
    """GEM at n workers (gem-nN) against the momentum proxy (momentum-n1). With repeats over seeds
    the checks are judged on the means over seeds, followed by each run's own (labelled) against
    the proxy run of the same seed (seed 0's where that one is missing)."""
    groups = group_by_config(summaries)
    proxies = groups.get("momentum-n1")
    if not proxies:
        return []
    gem = sorted(
        (group for name, group in groups.items() if name == f"gem-n{group[0].workers}"), key=lambda g: g[0].workers
    )
    seeded = any(len(group) > 1 for group in groups.values())
    checks: list[Check] = []
    if seeded:
        proxy_mean = aggregate("momentum-n1", proxies)
        for group in gem:
            mean = aggregate(base_name(group[0].name), group)
            checks.append(
                compare_to_proxy(mean, proxy_mean, label=f"mean over seeds ({mean.runs} runs, proxy {proxy_mean.runs})")
            )
    proxy_by_seed = {s.seed: s for s in proxies}
    for group in gem:
        for s in group:
            proxy = proxy_by_seed.get(s.seed, proxies[0])
            label = f"single run (seed {s.seed}, proxy {proxy.name})" if seeded else ""
            checks.append(compare_to_proxy(s, proxy, label=label))
    return checks


def _mb(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.1f}"


def summary_table(summaries: Sequence[Summary]) -> str:
    header = (
        "| run | workers | eta | kappa | commits | MB moved | steps/worker | "
        "final train loss (mini-batch, workers' copies) | full-train loss | full-train acc | held-out loss | "
        "held-out acc | median pi (mean over commits) | mean pi | "
        "pi=0 | pi=max | mean staleness | diverged | wall s |"
    )
    lines = [header, "|" + "---|" * 19]
    for s in summaries:
        lines.append(
            f"| {s.name} | {s.workers} | {s.learning_rate:g} | {s.kappa:g} | {s.commits} | {_mb(s.bytes_moved)} | "
            f"{s.worker_steps} | {s.final_training_loss:.4f} | {s.final_train_loss_full:.4f} | "
            f"{100 * s.final_train_accuracy_full:.2f}% | {s.held_out_loss:.4f} | {100 * s.held_out_accuracy:.2f}% | "
            f"{s.median_pi:.3f} | {s.mean_pi:.3f} | {s.fraction_pi_zero:.2f} | {s.fraction_pi_max:.2f} | "
            f"{s.mean_staleness:.1f} | {s.diverged_workers} | {s.wall_seconds:.0f} |"
        )
    return "\n".join(lines)


def _pm(a: Aggregate, field: str, scale: float = 1.0, digits: int = 4, unit: str = "") -> str:
    return f"{scale * a.mean[field]:.{digits}f} ± {scale * a.sd[field]:.{digits}f}{unit}"


def aggregate_table(found: Sequence[Aggregate]) -> str:
    """Mean ± sample sd (ddof=1) over seeds, one row per configuration run with >= 2 seeds."""
    target = f"{100 * TARGET_ACCURACY:g}%"
    header = (
        "| config | workers | runs | held-out acc | held-out loss | final train loss (mini-batch) | "
        f"full-train loss | mean staleness | wall s | s to {target} (runs there) | "
        f"mini-batches/worker to {target} | commits | MB moved |"
    )
    lines = [header, "|" + "---|" * 13]
    for a in found:
        reached = int(a.mean.get("seconds_to_target_runs", 0))
        lines.append(
            f"| {a.name} | {a.workers} | {a.runs} | {_pm(a, 'held_out_accuracy', 100, 2, '%')} | "
            f"{_pm(a, 'held_out_loss')} | {_pm(a, 'final_training_loss')} | {_pm(a, 'final_train_loss_full')} | "
            f"{_pm(a, 'mean_staleness', digits=1)} | {_pm(a, 'wall_seconds', digits=0)} | "
            f"{_pm(a, 'seconds_to_target', digits=1)} ({reached}/{a.runs}) | {_pm(a, 'steps_to_target', digits=0)} | "
            f"{a.mean['commits']:.0f} | {_mb(a.mean['bytes_moved'])} |"
        )
    return "\n".join(lines)


def describe_setting(config: RunConfig) -> str:
    """A run's own settings: a worker mode's, e.g. "lambda=10, local sgd", or the rule and eta
    for the gradient mode, e.g. "gem, eta=0.05"."""
    mode = config.mode
    if mode == "agn":
        setting = f"lambda={config.agn_steps}"
    elif mode == "dynsgd":
        setting = f"lambda={config.dynsgd_steps}"
    elif mode == "easgd":
        setting = f"tau={config.easgd_period}, alpha={config.easgd_alpha:g}"
    else:
        return f"{config.training.rule}, eta={config.training.learning_rate:g}"
    local = config.local_optimizer
    if config.local_learning_rate:
        local += f" lr {config.local_learning_rate:g}"
    return f"{setting}, local {local}"


def sweep_table(summaries: Sequence[Summary], settings: dict[str, str]) -> str:
    """The sweep-* runs per setting: final held-out accuracy and full-train loss (mean ± sd with seeds)."""
    groups = {name: g for name, g in group_by_config(summaries).items() if name.startswith("sweep-")}
    if not groups:
        return ""
    lines = [
        "| setting | method | workers | runs | held-out acc | full-train loss | final train loss (mini-batch) |",
        "|" + "---|" * 7,
    ]
    for name, group in groups.items():
        a = aggregate(name, group)
        if a.runs > 1:
            acc, full, batch = (
                _pm(a, "held_out_accuracy", 100, 2, "%"),
                _pm(a, "final_train_loss_full"),
                _pm(a, "final_training_loss"),
            )
        else:
            s = group[0]
            acc = f"{100 * s.held_out_accuracy:.2f}%"
            full, batch = f"{s.final_train_loss_full:.4f}", f"{s.final_training_loss:.4f}"
        setting = settings.get(group[0].name, "")
        lines.append(f"| {name} | {a.mode} {setting} | {a.workers} | {a.runs} | {acc} | {full} | {batch} |")
    return "\n".join(lines)


def write_results_markdown(
    path: Path,
    summaries: Sequence[Summary],
    checks: Sequence[Check],
    drawn: Sequence[Path],
    command: str,
    discussion: str,
    settings: dict[str, str] | None = None,
) -> None:
    """`settings`: run name -> its worker mode's settings (describe_setting), for the sweep table."""
    rel = [os.path.relpath(p, path.parent) for p in drawn]
    check_lines = [f"- {'met' if c.passed else 'NOT met'}: {c.claim} ({c.detail})" for c in checks]
    found = aggregates(summaries)
    seeds_section = (
        f"""## Mean ± sd over seeds

Configurations run with several seeds (runs NAME, NAME-s1, NAME-s2, ...: seed k orders worker
i's data with seed k * 100000 + i and, for k >= 1, builds the initial weights with seed k);
sample standard deviation (ddof = 1). Also in summary_by_config.json.

{aggregate_table(found)}

"""
        if found
        else ""
    )
    sweep = sweep_table(summaries, settings or {})
    sweep_section = f"## Settings sweep\n\n{sweep}\n\n" if sweep else ""
    text = f"""# Results: GEM against asynchronous SGD, reproduced with the real service

Generated by `{command}` (the tables, checks and figures below; the discussion is written by hand).
Every run starts a real `gemps server` and real worker loops talking gRPC on this machine.

## Settings

Data: scikit-learn's handwritten digits (1,438 training / 359 held-out 8x8 images; MNIST cannot
be downloaded here). Model: `digits-cnn` (two 3x3 convolutions, 38,282 parameters). Every worker
runs over the whole training set in its own shuffled order (the paper's setting), batch 64, so
one epoch is 22 worker steps. Defaults: eta = 0.05, mu = 0.9, kappa = 1, pi_max = 5.
"Final train loss (mini-batch, workers' copies)" averages the last 10% of worker steps of the
per-step mean over workers of each mini-batch's loss, measured on each worker's own, stale copy
of the parameters before its commit; "full-train loss" and "full-train acc" are the final
central variable's on the whole training set, as are the held-out figures on the held-out set.
"MB moved": 10^6 bytes the workers sent and received, 4P bytes (float32, P parameters) each way
per commit (a commit in --compression codes: their bytes instead), plus a 4P pull per commit in
the easgd mode. pi statistics pool every commit after
the first 10% of the run.

## Summary

{summary_table(summaries)}

{seeds_section}{sweep_section}## Checks against the momentum proxy (equal worker steps)

{chr(10).join(check_lines) or "- (no momentum proxy run in this suite)"}

## Figures

{chr(10).join(f"![{p}]({p})" for p in rel)}

{discussion}
"""
    path.write_text(text)
