"""PNG of tuning sweeps: held-out loss against workers, one line per eta, the single momentum-SGD
worker at N = 1, the recipe's run starred and the kappa probe crossed; one panel per plan.

    python -m gemps_worker.experiment.tuning_plot docs/results/tuning/lm.jsonl \
        docs/results/tuning/digits.jsonl --out docs/results/tuning/tuning.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from gemps_worker.experiment.tuning import RunSummary, loss_key


def read_runs(path: Path) -> list[RunSummary]:
    raws = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [RunSummary(**{k: v for k, v in raw.items() if k != "kind"}) for raw in raws if raw["kind"] == "run"]


def plot_tuning(paths: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths, strict=True):
        runs = [r for r in read_runs(path) if loss_key(r) != math.inf]
        for eta in sorted({r.eta for r in runs if r.phase == "sweep"}):
            line = sorted((r.workers, r.held_out_loss) for r in runs if r.phase == "sweep" and r.eta == eta)
            single = [r.held_out_loss for r in runs if r.phase == "sgd" and r.eta == eta]
            points = [(1, single[0]), *line] if single else line
            ax.plot(*zip(*points, strict=True), "o-", label=f"GEM, eta {eta:g} (N = 1: momentum SGD)")
        for r in runs:
            if r.phase == "sgd":
                ax.plot(1, r.held_out_loss, "k.", alpha=0.4)
                ax.annotate(f"{r.eta:g}", (1, r.held_out_loss), textcoords="offset points", xytext=(4, 0), fontsize=7)
            elif r.phase == "recipe":
                ax.plot(r.workers, r.held_out_loss, "*", color="red", markersize=14, label="the recipe", zorder=3)
            elif r.phase == "kappa":
                # Nudged right: it often sits on the recipe's star.
                ax.plot(r.workers * 1.1, r.held_out_loss, "x", color="purple", markersize=9, label=f"kappa {r.kappa:g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers N (each the same commits)")
        ax.set_ylabel("final held-out loss (log)")
        ax.set_title(path.stem)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", type=Path, nargs="+", help="PLAN.jsonl files written by the tuning sweep")
    parser.add_argument("--out", type=Path, required=True, help="the PNG")
    args = parser.parse_args()
    print(plot_tuning(args.plans, args.out))


if __name__ == "__main__":
    main()
