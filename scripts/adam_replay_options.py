"""The AdamW replay's command line (scripts/adam_staleness.py): its options, and every check on them
made before a run starts, so a mistake in the last variant or seed costs no run before it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from adam_replay_data import MODELS, SCHEDULES

from gemps.pytorch.beta1_ramp import RECIPE_SHARE
from gemps_server.domain.rules.gem_base import GEM_OWN_STEP

WORKERS = 4  # unless --workers
# Each variant's name (before its ":"), and the ones that take windows of local steps.
WINDOWED = ("local", "ahead", "job", "dana", "dn", "as", "gem")
VARIANTS = ("single", "stale", "dc", "mean", "pred", "ddp", "rounds", "windows", *WINDOWED)
STOPPABLE = ("local", "ahead", "job", "dana", "single", "stale", "dc", "mean", "pred", "ddp", "windows")


def parsed(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The replay's options from `argv` (the command line when None), checked; exits with the
    parser's error (status 2), naming the option, on the first that is wrong."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["single", "stale:3", "mean:4", "local:1"])
    parser.add_argument("--samples", type=int, default=12_800, help="samples per variant (all workers together)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--evaluations", type=int, default=8)
    parser.add_argument("--dc-lambda", type=float, default=1.0, help="dc:S's compensation factor")
    parser.add_argument(
        "--prediction", type=float, default=1.0, help="pred:K's share of the move it predicts (0: mean:K)"
    )
    parser.add_argument("--dn-learning-rate", type=float, default=0.7, help="dn:H's outer learning rate ε")
    parser.add_argument("--dn-momentum", type=float, default=0.9, help="dn:H's outer Nesterov momentum β")
    parser.add_argument(
        "--warmup",
        type=int,
        help="nanoGPT's schedule: this many warm-up steps, then a cosine decay to a tenth of the rate "
        "over the run (each worker's own share of it); constant when not given",
    )
    parser.add_argument("--outer-rate", type=float, default=1.0, help="windows:H's outer_rate (1: averaged)")
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="windows:H's outer_momentum (Nesterov)")
    parser.add_argument("--ahead", type=float, default=1.0, help="ahead:H's share of θ's expected move")
    parser.add_argument("--gem-outer", type=float, default=0.35, help="gem:H's factor on each window's update")
    parser.add_argument(
        "--gem-momentum", type=float, default=0.9, help="gem:H's proxy momentum μ (0: the window itself)"
    )
    parser.add_argument("--gem-kappa", type=float, default=1.0, help="gem:H's κ, the proxy's amplification")
    parser.add_argument("--gem-pi-max", type=float, default=5.0, help="gem:H's clamp on π")
    parser.add_argument(
        "--gem-own-step",
        choices=GEM_OWN_STEP,
        default="counted",
        help="whether gem:H's c counts the worker's own previous window",
    )
    parser.add_argument("--workers", type=int, default=WORKERS, help="N, the workers taking turns")
    parser.add_argument("--fresh", action="store_true", help="every window starts at the newest θ (no staleness)")
    parser.add_argument("--model", choices=tuple(MODELS), default="nanogpt", help="what the workers train")
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        help="the model's initialisation and the data's split and order; several: every variant at each, "
        "and each variant's mean over them with its standard error",
    )
    parser.add_argument("--beta1", type=float, help="Adam's β1 instead of the model's optimizer's (nanoGPT's 0.9)")
    parser.add_argument(
        "--beta1-to", type=float, help="windows:H: each worker's β1 rises to this (gemps.pytorch.Beta1Ramp)"
    )
    parser.add_argument("--beta1-ramp", type=float, help="windows:H: the share of each worker's steps it rises over")
    parser.add_argument("--beta2", type=float, help="Adam's β2 instead of the model's optimizer's (nanoGPT's 0.99)")
    parser.add_argument(
        "--schedule",
        choices=tuple(SCHEDULES),
        default="cosine",
        help="the rate's shape after --warmup: nanoGPT's cosine to a tenth, or the Trainer's linear to 0 "
        "(which decays from the start when no --warmup is given)",
    )
    parser.add_argument("--batch", type=int, help="windows a worker's step, instead of the model's own batch")
    parser.add_argument(
        "--weight-decay", type=float, help="AdamW's decay of the groups that decay, instead of the model's (0.1)"
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        help="end after this many samples of the --samples the schedules plan for (a read early in a long run; "
        "not for rounds:K)",
    )
    parser.add_argument(
        "--round-momentum",
        action="store_true",
        help="windows:H: each worker's AdamW first moment set from the round's move (LocalSteps' round_momentum=True)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants if v.partition(":")[0] not in VARIANTS]
    if unknown:
        parser.error(
            f"unknown variant {unknown[0]!r}: single, stale:S, dc:S, mean:K, pred:K, ddp:K, rounds:K, "
            "windows:H, local:H, ahead:H, job:H, dana:H, dn:H, as:H or gem:H"
        )
    if args.round_momentum and any(v.partition(":")[0] != "windows" for v in args.variants):
        parser.error(f"--round-momentum is for windows:H: not with {' '.join(args.variants)}")
    if args.weight_decay is not None and args.weight_decay < 0:
        parser.error(f"--weight-decay must be at least 0, not {args.weight_decay}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be at least 1, not {args.batch}")
    for name in ("workers", "evaluations", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    for name in ("beta1", "beta2"):
        beta = getattr(args, name)
        if beta is not None and not 0 <= beta < 1:
            parser.error(f"--{name} must be at least 0 and below 1, not {beta}")
    if args.beta1_ramp is not None and args.beta1_to is None:
        parser.error(f"--beta1-ramp {args.beta1_ramp:g} without --beta1-to: give the β1 it rises to")
    args.beta1_ramp = RECIPE_SHARE if args.beta1_ramp is None else args.beta1_ramp  # the guide's recipe
    if args.beta1_to is not None:
        others = [v for v in args.variants if v.partition(":")[0] != "windows"]
        if others or not 0 <= args.beta1_to < 1 or not 0 < args.beta1_ramp <= 1:
            parser.error(
                f"--beta1-to is a β1 in [0, 1) for windows:H, reached over --beta1-ramp of the steps (above 0, "
                f"at most 1): not {args.beta1_to:g} over {args.beta1_ramp:g} with {' '.join(args.variants)}"
            )
    held = [v for v in args.variants if v.partition(":")[0] not in WINDOWED]
    if args.fresh and held:
        parser.error(f"--fresh is for windows of local steps ({', '.join(WINDOWED)}), not {', '.join(held)}")
    unstoppable = [v for v in args.variants if v.partition(":")[0] not in STOPPABLE]
    if args.stop_at is not None and (unstoppable or not 0 < args.stop_at <= args.samples):
        parser.error(
            f"--stop-at is for {', '.join(STOPPABLE)}, at most --samples: not {args.stop_at} "
            f"with {' '.join(args.variants)}"
        )
    if len(set(args.seed)) != len(args.seed) or min(args.seed) < 0:
        parser.error(f"--seed takes distinct seeds of at least 0, not {' '.join(map(str, args.seed))}")
    batch = args.batch or MODELS[args.model].batch
    steps = args.samples // batch
    if args.stop_at is not None and args.stop_at // batch < steps // args.evaluations:
        first = steps // args.evaluations * batch
        parser.error(f"--stop-at {args.stop_at} ends before the first evaluation, at {first} samples")
    return args
