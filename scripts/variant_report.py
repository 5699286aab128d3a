"""A configuration against its variants, from `gemps experiment` runs: held-out figures over seeds
and pi's distribution over commits, as a markdown table and JSON. GEM's state exact against compact
(`--suite gem-state`, issue 45), commits in float32 against int8 and int4 codes (`--suite
compression`, issue 47):

    PYTHONPATH=proto:server:client_sdk:worker .venv/bin/python scripts/variant_report.py runs/gem-state \\
        --variant compact --json docs/results/gem_state/accuracy.json --markdown docs/results/gem_state/accuracy.md
    ... scripts/variant_report.py runs/compression --variant int8 --variant int4 ...

A configuration NAME is compared with each NAME-VARIANT, each over its seeds (NAME-sK).
pi's distribution: every commit after the first tenth of the run gives its mean pi over the
parameters (the median over parameters is 0 past a few workers, so it says little), and the
table gives the median and the 90th percentile of those over the commits of all seeds, and the
shares of parameters at 0 and at pi_max averaged over the same commits.
"""

from __future__ import annotations

import argparse
import json
import math
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


def seconds_to(result: dict[str, Any], accuracy: float) -> float:
    """Seconds of training to a run's first held-out evaluation at `accuracy` or above (inf: never):
    from its last evaluation of the initial θ (version 0; its first evaluation where commits came
    before it), so the start-up every variant shares (the server, the worker processes importing
    torch) is left out, to the evaluations' period (1 s)."""
    held_out = result["held_out"]
    first = held_out[0]["time"] if held_out else 0.0
    start = max((h["time"] for h in held_out if h["version"] == 0), default=first)
    return next((h["time"] - start for h in held_out if h["accuracy"] >= accuracy), math.inf)


def summary(results: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
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
        **({} if target is None else {"seconds_to_target": statistics.median(seconds_to(r, target) for r in results)}),
    }


def row(name: str, variant: str, figures: dict[str, Any]) -> str:
    to_target = f" {figures['seconds_to_target']:.1f} |" if "seconds_to_target" in figures else ""
    return (
        f"| {name} | {variant} | {figures['seeds']} | {figures['held_out_accuracy']:.2f} ± "
        f"{figures['held_out_accuracy_sd']:.2f}% | {figures['held_out_loss']:.4f} | "
        f"{figures['pi_mean_median']:.3f} | {figures['pi_mean_p90']:.3f} | {figures['at_zero']:.2f} | "
        f"{figures['at_max']:.2f} |{to_target}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the experiment's --out folder")
    parser.add_argument("--variant", action="append", help="a variant's suffix (repeat; default: compact)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="add seconds to this held-out accuracy (0-1; median of seeds)",
    )
    args = parser.parse_args()
    target = args.target_accuracy
    found = runs_of(args.runs)
    variants = args.variant or ["compact"]
    table = [
        "| configuration | variant | seeds | held-out accuracy (mean ± sd) | held-out loss "
        "| per-commit mean pi: median | 90th percentile | pi = 0 | pi = pi_max |"
        + ("" if target is None else f" seconds to {100 * target:g}% |"),
        "|---|---|---|---|---|---|---|---|---|" + ("" if target is None else "---|"),
    ]
    report: dict[str, dict[str, Any]] = {}
    for name in sorted(n for n in found if any(f"{n}-{v}" in found for v in variants)):
        base = summary(found[name], target)
        report[name] = {"base": base}
        table.append(row(name, "base", base))
        for variant in (v for v in variants if f"{name}-{v}" in found):
            figures = summary(found[f"{name}-{variant}"], target)
            gaps = {
                "accuracy_gap_points": figures["held_out_accuracy"] - base["held_out_accuracy"],
                "pi_median_ratio": figures["pi_mean_median"] / base["pi_mean_median"],
                "pi_p90_ratio": figures["pi_mean_p90"] / base["pi_mean_p90"],
            }
            report[name][variant] = {**figures, **gaps}
            table.append(row(name, variant, figures))
            table.append(
                f"| {name} | {variant} - base | | {gaps['accuracy_gap_points']:+.2f} points | "
                f"{figures['held_out_loss'] - base['held_out_loss']:+.4f} | x{gaps['pi_median_ratio']:.3f} | "
                f"x{gaps['pi_p90_ratio']:.3f} | | |"
                + ("" if target is None else f" x{base['seconds_to_target'] / figures['seconds_to_target']:.2f} |")
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
