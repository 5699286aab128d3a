"""GEM's state exact against compact, from `gemps experiment --suite gem-state` runs (issue 45):
held-out figures over seeds and pi's distribution over commits, as a markdown table and JSON.

    PYTHONPATH=proto:server:client_sdk:worker .venv/bin/python scripts/gem_state_report.py runs/gem-state \\
        --json docs/results/gem_state/accuracy.json --markdown docs/results/gem_state/accuracy.md

A pair is a configuration NAME (the exact state) and NAME-compact, each over its seeds (NAME-sK).
pi's distribution: every commit after the first tenth of the run gives its mean pi over the
parameters (the median over parameters is 0 past a few workers, so it says little), and the
table gives the median and the 90th percentile of those over the commits of all seeds, and the
shares of parameters at 0 and at pi_max averaged over the same commits.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

SEED = re.compile(r"-s(\d+)$")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def runs_of(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Configuration name -> its runs' result.json (one per seed)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for result in sorted(folder.glob("*/result.json")):
        name = SEED.sub("", result.parent.name)
        found.setdefault(name, []).append(json.loads(result.read_text()))
    return found


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    accuracy = [100 * r["final_accuracy"] for r in results]
    loss = [r["final_loss"] for r in results]
    means, zeros, maxes = [], [], []
    for result in results:
        records = result["records"]
        for record in records[len(records) // 10 :]:
            means.append(record["scaling_mean"])
            zeros.append(record["scaling_at_zero"])
            maxes.append(record["scaling_at_max"])
    spread = statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0
    return {
        "seeds": len(results),
        "held_out_accuracy": statistics.mean(accuracy),
        "held_out_accuracy_sd": spread,
        "held_out_accuracies": accuracy,
        "held_out_loss": statistics.mean(loss),
        "held_out_losses": loss,
        "pi_mean_median": statistics.median(means),
        "pi_mean_p90": percentile(means, 0.9),
        "at_zero": statistics.mean(zeros),
        "at_max": statistics.mean(maxes),
        "commits": len(means),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the experiment's --out folder")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    found = runs_of(args.runs)
    pairs = {name: (found[name], found[f"{name}-compact"]) for name in found if f"{name}-compact" in found}
    table = [
        "| configuration | state | seeds | held-out accuracy (mean ± sd) | held-out loss "
        "| per-commit mean pi: median | 90th percentile | pi = 0 | pi = pi_max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    report = {}
    for name, (exact_runs, compact_runs) in pairs.items():
        exact, compact = summary(exact_runs), summary(compact_runs)
        report[name] = {
            "exact": exact,
            "compact": compact,
            "accuracy_gap_points": compact["held_out_accuracy"] - exact["held_out_accuracy"],
            "pi_median_ratio": compact["pi_mean_median"] / exact["pi_mean_median"],
            "pi_p90_ratio": compact["pi_mean_p90"] / exact["pi_mean_p90"],
        }
        for state, figures in (("exact", exact), ("compact", compact)):
            table.append(
                f"| {name} | {state} | {figures['seeds']} | {figures['held_out_accuracy']:.2f} ± "
                f"{figures['held_out_accuracy_sd']:.2f}% | {figures['held_out_loss']:.4f} | "
                f"{figures['pi_mean_median']:.3f} | {figures['pi_mean_p90']:.3f} | {figures['at_zero']:.2f} | "
                f"{figures['at_max']:.2f} |"
            )
        gaps = report[name]
        table.append(
            f"| {name} | compact - exact | | {gaps['accuracy_gap_points']:+.2f} points | "
            f"{compact['held_out_loss'] - exact['held_out_loss']:+.4f} | x{gaps['pi_median_ratio']:.3f} | "
            f"x{gaps['pi_p90_ratio']:.3f} | | |"
        )
    text = "\n".join(table) + "\n"
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
