"""The tuning guide's recipe put to the test: pick GEM's eta, mu, kappa and the number of workers
from one momentum-SGD worker and the noise-scale gauge, and compare with a sweep.

Every run takes the same S commits per worker, so N workers train on N*S*b samples: equal wall
time where each worker has its own machine, which is what workers are for (on equal samples one
worker always wins: docs/RESULTS.md, "Tuning"):

(a) one momentum-SGD worker (rule momentum), for each eta of a grid;
(b) the recipe: GEM with the best (a) run's eta and mu, kappa at its default (1), and N = the
    noise-scale gauge's "workers that pay" read during that run (median over its second half,
    B_noise / b, at least 1);
(c) a small sweep: GEM, each eta of a grid x each N of a grid;
(d) one run at kappa = 2 with the recipe's eta and N (does raising kappa help?).

Every run is single_run.run: a real `gemps server` and real worker loops. Selection and the gap
use the final central variable's held-out loss (nats per character for stdlib-text).
Results go to OUT/<name>.jsonl, one line per run, and a last line with the recipe's verdict.

    python -m gemps_worker.experiment.tuning --plan lm --out runs/tuning --report docs/results/tuning
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gemps_proto.schema import TrainingConfig
from gemps_worker.datasets import load_dataset
from gemps_worker.experiment.single_run import RunConfig, RunResult, run

log = logging.getLogger("gemps.tuning")


@dataclass(frozen=True)
class TuningPlan:
    name: str
    model: str
    dataset: str
    batch_size: int
    steps: int  # commits per worker (S), whatever N
    sgd_etas: tuple[float, ...]  # (a)
    gem_etas: tuple[float, ...]  # (c)
    gem_workers: tuple[int, ...]  # (c)
    momentum: float = 0.9
    kappa_probe: float = 2.0  # (d)
    eval_interval: float = 1.0  # seconds between held-out evaluations (and gauge readings)


PLANS = {
    # About 40 ms a step for one free core (2 layers, width 64); one worker trains on 6,400 windows.
    "lm": TuningPlan(
        "lm", "char-gpt", "stdlib-text", 32, 200, (0.03, 0.1, 0.3), (0.05, 0.1), (2, 4, 8), eval_interval=10.0
    ),
    # One worker: 220 commits of 64, ten passes over the 1,438 images.
    "digits": TuningPlan("digits", "digits-cnn", "digits", 64, 220, (0.01, 0.03, 0.1, 0.3), (0.03, 0.1), (2, 4, 8)),
    # CI's: seconds, to check the machinery, not the figures.
    "lm-quick": TuningPlan("lm-quick", "char-gpt", "stdlib-text", 16, 20, (0.3,), (0.3,), (2,), eval_interval=0.5),
}
# A server start can pass its 30 s on a loaded machine: a run is tried this many times.
TRIES = 3


@dataclass(frozen=True)
class RunSummary:
    phase: str  # sgd | recipe | sweep | kappa
    name: str
    rule: str
    eta: float
    mu: float
    kappa: float
    workers: int
    batch_size: int
    samples: int  # commits x batch: what the run trained on
    commits: int
    held_out_loss: float  # the final central variable's
    held_out_accuracy: float
    noise_scale: float  # median gauge reading (samples) over the run's second half; NaN: none
    useful_workers: float  # noise_scale / batch_size
    diverged_workers: int
    wall_seconds: float


def gauge_median(result: RunResult) -> float:
    """Median B_noise (samples) over the second half of the run's finite gauge readings."""
    readings = [scale for _, _, scale in result.noise_scale if math.isfinite(scale)]
    return statistics.median(readings[len(readings) // 2 :]) if readings else math.nan


def run_config(
    plan: TuningPlan, name: str, rule: str, eta: float, workers: int, kappa: float = 1.0, seed: int = 0
) -> RunConfig:
    """N workers of the plan's batch, each stopping after the plan's steps."""
    steps = plan.steps
    train_size = len(load_dataset(plan.dataset).train_x)
    options = {"momentum": plan.momentum, **({"kappa": kappa} if rule == "gem" else {})}  # momentum SGD has no kappa
    training = TrainingConfig(rule=rule, learning_rate=eta, rule_options=options, batch_size=plan.batch_size)
    return RunConfig(
        name,
        workers,
        training=training,
        epochs=math.ceil(steps * plan.batch_size / train_size) + 1,
        model=plan.model,
        dataset=plan.dataset,
        max_steps=steps,
        seed=seed,
    )


def summarise(phase: str, config: RunConfig, result: RunResult) -> RunSummary:
    scale = gauge_median(result)
    training = config.training
    return RunSummary(
        phase,
        config.name,
        training.rule,
        training.learning_rate,
        training.rule_options["momentum"],
        config.kappa,
        config.workers,
        training.batch_size,
        len(result.records) * training.batch_size,
        len(result.records),
        result.final_loss,
        result.final_accuracy,
        scale,
        scale / training.batch_size,
        result.diverged_workers,
        result.wall_seconds,
    )


def loss_key(summary: RunSummary) -> float:
    """Held-out loss, a diverged or non-finite run last."""
    if summary.diverged_workers or not math.isfinite(summary.held_out_loss):
        return math.inf
    return summary.held_out_loss


def recipe_workers(sgd: RunSummary) -> int:
    """The gauge's workers that pay, read during the best single worker's run: at least 1."""
    return max(1, round(sgd.useful_workers)) if math.isfinite(sgd.useful_workers) else 1


def judge(runs: list[RunSummary]) -> dict[str, Any]:
    """The recipe's run against the best of every other setting but the kappa probe (one worker's
    included: a worker count of the sweep too)."""
    recipe = next(r for r in runs if r.phase == "recipe")
    kappa = next(r for r in runs if r.phase == "kappa")
    best_sgd = min((r for r in runs if r.phase == "sgd"), key=loss_key)
    best = min((r for r in runs if r.phase != "kappa"), key=loss_key)
    return {
        "best_sgd": best_sgd.name,
        "recipe": {"eta": recipe.eta, "mu": recipe.mu, "kappa": recipe.kappa, "workers": recipe.workers},
        "recipe_loss": recipe.held_out_loss,
        "best": best.name,
        "best_loss": best.held_out_loss,
        "gap": recipe.held_out_loss - best.held_out_loss,
        "kappa_probe": kappa.kappa,
        "kappa_probe_loss": kappa.held_out_loss,
    }


def plan_file(plan: str, seed: int) -> str:
    """PLAN.jsonl for seed 0, PLAN-sK.jsonl for seed K (the experiment suites' naming)."""
    return f"{plan}.jsonl" if seed == 0 else f"{plan}-s{seed}.jsonl"


class Tuning:
    """Runs a plan's phases, appending each run's summary to OUT/<plan>.jsonl as it ends.
    `parallel` runs at a time: results are counted in samples, not seconds, so runs sharing the
    machine change only their wall time (and the interleaving of a run's workers)."""

    def __init__(
        self, plan: TuningPlan, out: Path, report: Path, parallel: int = 1, resume: bool = False, seed: int = 0
    ) -> None:
        self.plan, self.out, self.report, self.parallel, self.seed = plan, out, report, parallel, seed
        report.mkdir(parents=True, exist_ok=True)
        self.lines = report / plan_file(plan.name, seed)
        self.lock = threading.Lock()
        self.done: dict[tuple[str, float, int, float], RunSummary] = {}
        if resume and self.lines.exists():  # runs of an interrupted sweep (same plan) are kept
            for line in self.lines.read_text().splitlines():
                raw = json.loads(line)
                if raw.pop("kind") == "run":
                    summary = RunSummary(**raw)
                    self.done[(summary.rule, summary.eta, summary.workers, summary.kappa)] = summary
        self.lines.write_text("")

    def measure(self, phase: str, rule: str, eta: float, workers: int, kappa: float = 1.0) -> RunSummary:
        key = (rule, eta, workers, kappa)
        if key in self.done:  # the recipe's point may be a sweep point: measured once
            summary = replace(self.done[key], phase=phase)
        else:
            name = f"{rule}-n{workers}-eta{eta:g}" + (f"-kappa{kappa:g}" if kappa != 1.0 else "")
            name += f"-s{self.seed}" if self.seed else ""
            config = run_config(self.plan, name, rule, eta, workers, kappa, self.seed)
            summary = summarise(phase, config, self.run_with_tries(config))
            self.done[key] = summary
        log.info(
            "%s: %s held-out %.4f (gauge %.3g workers)",
            phase,
            summary.name,
            summary.held_out_loss,
            summary.useful_workers,
        )
        with self.lock, self.lines.open("a") as lines:
            lines.write(json.dumps({"kind": "run", **asdict(summary)}) + "\n")
        return summary

    def run_with_tries(self, config: RunConfig) -> RunResult:
        for attempt in range(1, TRIES + 1):
            log.info("%s (try %d)", config.name, attempt)
            try:
                return run(config, self.out / self.plan.name / f"{config.name}-try{attempt}", self.plan.eval_interval)
            except TimeoutError as error:
                if attempt == TRIES:
                    raise
                log.warning("%s: %s; again", config.name, str(error).splitlines()[0])
        raise AssertionError("unreachable")

    def measure_all(self, runs: list[tuple[str, str, float, int, float]]) -> list[RunSummary]:
        """(phase, rule, eta, workers, kappa) for each, `parallel` at a time, in order."""
        with ThreadPoolExecutor(self.parallel) as pool:
            return list(pool.map(lambda spec: self.measure(*spec), runs))

    def all(self) -> dict[str, Any]:
        plan = self.plan
        # (a) and (c) need nothing from each other: together, then (b) and (d) from (a)'s best.
        first = self.measure_all(
            [("sgd", "momentum", eta, 1, 1.0) for eta in plan.sgd_etas]
            + [("sweep", "gem", e, n, 1.0) for e in plan.gem_etas for n in plan.gem_workers]
        )
        sgd, sweep = first[: len(plan.sgd_etas)], first[len(plan.sgd_etas) :]
        best_sgd = min(sgd, key=loss_key)
        eta, workers = best_sgd.eta, recipe_workers(best_sgd)
        recipe, kappa = self.measure_all(
            [("recipe", "gem", eta, workers, 1.0), ("kappa", "gem", eta, workers, plan.kappa_probe)]
        )
        verdict = {"kind": "verdict", "plan": asdict(plan), **judge([*sgd, *sweep, recipe, kappa])}
        with self.lines.open("a") as lines:
            lines.write(json.dumps(verdict) + "\n")
        return verdict


def markdown(path: Path) -> str:
    """PLAN.jsonl as docs/RESULTS.md's tables: every run, then the recipe against the sweep's best."""
    raws = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = [RunSummary(**{k: v for k, v in raw.items() if k != "kind"}) for raw in raws if raw["kind"] == "run"]
    rows = [
        "| phase | rule | eta | kappa | workers | commits | samples | held-out loss | held-out accuracy "
        "| gauge: workers that pay | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_ in runs:
        loss = "diverged" if loss_key(run_) == math.inf else f"{run_.held_out_loss:.3f}"
        rows.append(
            f"| {run_.phase} | {run_.rule} | {run_.eta:g} | {run_.kappa:g} | {run_.workers} | {run_.commits:,} "
            f"| {run_.samples:,} | {loss} | {100 * run_.held_out_accuracy:.1f}% | {run_.useful_workers:.3g} "
            f"| {run_.wall_seconds:.0f} |"
        )
    if any(r.phase == "recipe" for r in runs) and any(r.phase == "kappa" for r in runs):
        v = judge(runs)
        recipe = v["recipe"]
        rows += [
            "",
            f"Recipe: eta = {recipe['eta']:g} and mu = {recipe['mu']:g} from {v['best_sgd']}, kappa = 1, "
            f"{recipe['workers']} workers: held-out {v['recipe_loss']:.3f}; best setting ({v['best']}) "
            f"{v['best_loss']:.3f}; gap {v['gap']:+.3f}; kappa = {v['kappa_probe']:g} at the recipe's eta "
            f"and workers: {v['kappa_probe_loss']:.3f}.",
        ]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=tuple(PLANS), default="lm")
    parser.add_argument("--out", type=Path, default=Path("runs/tuning"), help="runs' folders (logs, result.json)")
    parser.add_argument("--report", type=Path, default=Path("docs/results/tuning"), help="where PLAN.jsonl goes")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--resume", action="store_true", help="keep the runs REPORT/PLAN.jsonl already holds")
    parser.add_argument(
        "--seed", type=int, default=0, help="K > 0: other initial weights and data orders, to REPORT/PLAN-sK.jsonl"
    )
    parser.add_argument("--markdown", action="store_true", help="print REPORT/PLAN.jsonl's tables; run nothing")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(args.report / plan_file(args.plan, args.seed)), end="")
        return
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, not {args.parallel}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    verdict = Tuning(PLANS[args.plan], args.out, args.report, args.parallel, args.resume, args.seed).all()
    print(json.dumps(verdict))


if __name__ == "__main__":
    main()
