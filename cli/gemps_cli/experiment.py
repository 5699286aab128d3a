"""`gemps experiment`: the GEM paper's comparisons, and GEM against AGN, DynSGD and asynchronous
EASGD, with the real server; curves, figures, RESULTS.md."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from gemps_cli.bench import link_rate
from gemps_worker.datasets import DATASETS
from gemps_worker.experiment.analysis import base_name
from gemps_worker.experiment.on_links import between_hosts, link_problem
from gemps_worker.experiment.single_run import RunConfig
from gemps_worker.experiment.speedup import SpeedupConfig
from gemps_worker.experiment.speedup_fit import run_speedup
from gemps_worker.experiment.suite import SUITE_HELP, SUITES, with_seeds
from gemps_worker.experiment.suite_run import run_suite
from gemps_worker.models import MODELS


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a suite of training runs with the real server (resumable: finished runs are reused) and write "
        "curves, figures, summary.json and RESULTS.md. Suites: "
        + "; ".join(f"{name}: {text}" for name, text in SUITE_HELP.items())
        + ". With --seeds N every run is repeated N times (seed 0 keeps the run's name, seed k is NAME-sK), "
        "and RESULTS.md and summary_by_config.json give mean ± sd over seeds."
    )
    parser.add_argument(
        "--suite",
        choices=(*SUITES, *SPEEDUP_SUITES),
        default="full",
        help="which runs (default full): "
        + "; ".join(f"{name}: {text}" for name, text in {**SUITE_HELP, **SPEEDUP_SUITES}.items()),
    )
    parser.add_argument(
        "--runs", nargs="*", default=None, help="only these run names (see --list; a name without -sK: all its seeds)"
    )
    parser.add_argument(
        "--epochs", type=int, default=10, help="epochs per worker in the full, agn-sweep and agn suites (default 10)"
    )
    parser.add_argument(
        "--seeds",
        type=_positive,
        default=1,
        help="runs per configuration (default 1): seed 0 keeps the name, seed k >= 1 is NAME-sK; seed k orders "
        "worker i's data with seed k*100000+i and builds the initial weights with seed k; the report adds "
        "mean ± sd over seeds and judges the proxy checks on the means",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="train every run on this data set instead of digits (mnist, fashion-mnist: IDX files from ./data, "
        "downloaded and checked when missing); use another --out",
    )
    parser.add_argument(
        "--model", choices=tuple(MODELS), default=None, help="every run's model instead of digits-cnn (e.g. mnist-cnn)"
    )
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
    parser.add_argument(
        "--link",
        default=None,
        type=link_rate,
        metavar="RATE",
        help="run each job across a link of this rate (tc's form: 100mbit, 1gbit): the server on one simulated "
        "host, the workers and the observer on another (network namespaces; root only); use another --out",
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        default=SpeedupConfig.target_loss,
        help=f"speedup suite: the held-out loss every run trains to (default {SpeedupConfig.target_loss:g})",
    )
    parser.set_defaults(run=run)


SPEEDUP_SUITES = {
    "speedup": "samples and commits to a held-out loss target (--target-loss) with N = 1..64 workers per rule (GEM, "
    "DOWNPOUR, adaptive staleness), McCandlish's critical batch fitted to them beside the server's noise-scale gauge "
    "(gemps_worker.experiment.speedup; --seeds, --out, --markdown apply)",
    "speedup-quick": "the speedup suite reduced for CI: GEM with N = 1, 2, 4, one seed, to a held-out loss of 1.0",
}


def run(args: argparse.Namespace) -> int:
    command = "gemps experiment " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["experiment"] else "gemps experiment"
    if args.suite in SPEEDUP_SUITES:
        if args.link is not None:
            print(f"gemps experiment: --link does not apply to the {args.suite} suite", file=sys.stderr)
            return 2
        report = args.report or args.out / "report"
        if not 0 < args.target_loss < SpeedupConfig.diverged_loss:
            print(f"gemps experiment: --target-loss must be in (0, {SpeedupConfig.diverged_loss:g})", file=sys.stderr)
            return 2
        config = SpeedupConfig(seeds=args.seeds, dataset=args.dataset or "digits", target_loss=args.target_loss)
        if args.suite == "speedup-quick":
            config = replace(config, rules=("gem",), workers=(1, 2, 4), seeds=1, target_loss=1.0, status_every=10)
        return run_speedup(config, args.out, report, args.markdown or report / "SPEEDUP.md", args.force, command)
    if args.dataset not in (None, "digits") and args.model is None:
        print(
            f"gemps experiment: --dataset {args.dataset} needs --model (e.g. mnist-cnn for 28x28 images, mlp)",
            file=sys.stderr,
        )
        return 2
    suite = with_seeds(SUITES[args.suite](args.epochs), args.seeds)
    if args.dataset is not None or args.model is not None:
        suite = [replace(c, dataset=args.dataset or c.dataset, model=args.model or c.model) for c in suite]
    if args.runs:
        unknown = set(args.runs) - {c.name for c in suite}
        if unknown:
            print(f"gemps experiment: unknown runs {sorted(unknown)}; see --list", file=sys.stderr)
            return 2
        suite = [c for c in suite if c.name in args.runs or base_name(c.name) in args.runs]
    if args.list:
        for c in suite:
            t = c.training
            print(
                f"{c.name:30s} rule={t.rule} workers={c.workers} eta={t.learning_rate:g} kappa={c.kappa:g} "
                f"mode={c.mode} {_mode_settings(c)}epochs={c.epochs} seed={c.seed} "
                f"dataset={c.dataset} model={c.model}"
            )
        return 0
    report = args.report or args.out / "report"
    discussion = args.discussion.read_text() if args.discussion and args.discussion.exists() else ""
    markdown = args.markdown or report / "RESULTS.md"
    if args.link is None:
        return run_suite(suite, args.out, report, markdown, discussion, args.force, command.strip())
    problem = link_problem(args.link)
    if problem is not None:
        print(f"gemps experiment: --link {args.link}: {problem}", file=sys.stderr)
        return 2
    with between_hosts(args.link) as placement:
        return run_suite(suite, args.out, report, markdown, discussion, args.force, command.strip(), placement)


def _mode_settings(c: RunConfig) -> str:
    """The worker mode's own settings for --list (with a trailing space), empty for gradient."""
    mode = c.mode
    local = f"local={c.local_optimizer}" + (f"@{c.local_learning_rate:g} " if c.local_learning_rate else " ")
    if mode == "agn":
        return f"agn_steps={c.agn_steps} {local}"
    if mode == "dynsgd":
        return f"dynsgd_steps={c.dynsgd_steps} {local}"
    if mode == "easgd":
        return f"easgd_period={c.easgd_period} easgd_alpha={c.easgd_alpha:g} {local}"
    return ""
