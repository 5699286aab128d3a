"""GEM with s_i taken before the step (`--gem-own-step counted`, the paper's reference code)
against s_i taken after it (`excluded`), on the experiment harness's runs (digits CNN, a real
`gemps server` and real worker loops), at 1, 5 and 30 workers, with momentum SGD beside them.

    PYTHONPATH=... python scripts/gem_own_step.py --epochs 5 --seeds 3 --out runs/own-step

Runs are interleaved (seed, workers, choice) so a cut-short measurement still compares like
with like; finished runs are reused. Each choice's report goes to OUT/<choice>/report, and a
table of means ± sd over seeds is printed. Results: docs/RESULTS.md ("GEM's letter").
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gemps_worker.experiment.analysis import aggregates, seeded_name, summarize
from gemps_worker.experiment.single_run import RunConfig, RunResult, run
from gemps_worker.experiment.suite import training

CHOICES = ("counted", "excluded")
FIELDS = ("held_out_accuracy", "held_out_loss", "final_train_loss_full", "final_training_loss", "steps_to_target")


def configs(workers: tuple[int, ...], epochs: int, seed: int) -> list[RunConfig]:
    return [RunConfig(seeded_name(f"gem-n{n}", seed), n, training("gem"), epochs=epochs, seed=seed) for n in workers]


def result_of(config: RunConfig, folder: Path, own_step: str) -> RunResult:
    saved = folder / "result.json"
    if saved.exists():
        return RunResult.load(saved)
    os.environ["GEMPS_GEM_OWN_STEP"] = own_step  # the server process inherits it
    try:
        return run(config, folder)
    finally:
        os.environ.pop("GEMPS_GEM_OWN_STEP", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", default="1,5,30")
    parser.add_argument("--out", type=Path, default=Path("runs/own-step"))
    args = parser.parse_args()
    workers = tuple(int(n) for n in args.workers.split(","))
    results: dict[str, list[RunResult]] = {choice: [] for choice in (*CHOICES, "momentum")}
    for seed in range(args.seeds):
        proxy = RunConfig(seeded_name("momentum-n1", seed), 1, training("momentum"), epochs=args.epochs, seed=seed)
        results["momentum"].append(result_of(proxy, args.out / "momentum" / proxy.name, "counted"))
        for config in configs(workers, args.epochs, seed):
            for choice in CHOICES:
                result = result_of(config, args.out / choice / config.name, choice)
                results[choice].append(result)
                s = summarize(result)
                print(
                    f"{choice:8s} {config.name:12s} acc {100 * s.held_out_accuracy:.2f}% "
                    f"full-train loss {s.final_train_loss_full:.4f} wall {s.wall_seconds:.0f}s",
                    flush=True,
                )
    print("| rule | config | runs | " + " | ".join(FIELDS) + " |")
    for choice, found in results.items():
        for a in aggregates([summarize(r) for r in found]):
            cells = " | ".join(f"{a.mean[f]:.4f} ± {a.sd[f]:.4f}" for f in FIELDS)
            print(f"| {choice} | {a.name} | {a.runs} | {cells} |")


if __name__ == "__main__":
    main()
