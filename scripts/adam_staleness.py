"""What asynchrony costs AdamW on a small character GPT, at equal samples (issue 59, item 1).

Before choosing an Adam-family path for gemps, this probe replays the candidate schemes in one
process, deterministically, without a server: N workers take turns in a fixed order (round robin,
the steady state of N equal asynchronous workers), each on its own shard of the standard library's
source (gemps_worker.text_data), with the same model, batch and number of samples as one AdamW
worker. What differs is only when and where Adam's step is taken:

- `single`: one worker, AdamW, every sample's gradient at the newest θ (the reference);
- `stale:S`: one AdamW on the server, fed gradients computed S updates ago (N workers in turn
  make S = N - 1; S = 0 is `single` with the shards interleaved);
- `mean:K`: one AdamW on the server, one step on the mean of K commits (a K-times larger batch),
  each worker's gradient taken at the θ of its own last reply (stale by at most one step);
- `pred:K`: `mean:K` with one-step weight prediction, as SpecTrain (Chen et al. 2018, "Efficient and
  Robust Parallel DNN Training through Model Parallelism on Multi-GPU Platform", arXiv:1809.02839)
  and PipeMare (Yang et al. 2021, arXiv:1910.05124) predict the weights a delayed gradient meets,
  the last server step's move standing for their smoothed gradient: each worker's gradient taken at
  θ_r + p·l·(θ_r - θ_b), θ_r its last reply, θ_b the θ of the server step before it, l how many
  server steps landed between its previous reply and its previous commit's use (N in turn, K = N:
  0 for the rank whose commit completes a round, 1 for the others), p `--prediction` (0: `mean:K`);
- `ddp:K`: the same step with every gradient taken at the newest θ: DDP with AdamW on K machines
  at a global batch of K times the batch (the reference a team with K machines would run);
- `rounds:K`: `ddp:K`'s computation by the server's `adamw` rule and its schedule (scripts/
  adam_rounds.py: N workers waiting for each round of K, as the SDK makes them);
- `windows:H`: rounds of the N workers' windows of H local AdamW steps, each from the round's θ
  (each worker its own moments and schedule), committed as updates to the server's `adamw` rule
  with `--outer-rate` r and `--outer-momentum` μ (scripts/adam_rounds.py): DiLoCo's outer Nesterov
  step on their mean (r 1, μ 0: the models averaged, local AdamW);
- `dc:S`: `stale:S` with the delay compensated as DC-ASGD-a does (Zheng et al. 2017): the gradient
  g computed at θ_then, fed as g + λ·g⊙g⊙(θ_now - θ_then)/√ms, ms the running mean of g⊙g
  (β 0.95), λ `--dc-lambda`: the diagonal of the Hessian approximated by g⊙g;
- `local:H`: every worker its own AdamW (its own moments), H local steps from the θ of its last
  reply, the window's update θ_H - θ_0 added to θ in full (`LocalSteps` with `--rule downpour`;
  H = 1: every step);
- `ahead:H`: `local:H` with LocalSteps' look-ahead (`look_ahead=`, `--ahead` of θ's expected
  move; gemps.pytorch.look_ahead): each window starts where θ is headed while the others commit;
- `job:H`: `ahead:H` with LocalSteps' `job_betas=True` (gemps.pytorch.job_betas): each worker's β1
  raised to the power of the job's commits per its own, so its momentum spans the job's samples;
- `dn:H`: the same windows, applied by the server's delayed-Nesterov rule (`LocalSteps` with
  `--rule delayed-nesterov`: asynchronous Local-SGD's outer step, Liu et al. 2024; the rule's own
  code, N the workers, ε `--dn-learning-rate`, β `--dn-momentum`): AdamW inside, Nesterov outside,
  as DiLoCo pairs them;
- `as:H`: the same windows, applied by the server's adaptive-staleness rule (its own code): each
  divided by its staleness plus one, the commits since its window started (N in turn: N);
- `gem:H`: the same windows times `--gem-outer`, applied by the server's GEM rule (its own code), by
  default at its defaults (μ 0.9, κ 1, π_max 5; `gemps worker --mode dynsgd --local-optimizer adam`,
  the comparison's gemps-gem-local). `--gem-momentum 0 --gem-own-step excluded --gem-outer 1` is
  GEM's energy matched to the worker's own AdamW window (issue 78, item 1): π = max(0, κ - c/|Δ|),
  c = |θ - s_i| what the others moved θ since worker i's last commit, so a round of N commits moves
  θ about κ times one AdamW step, as DDP's step on their N gradients does;
- `dana:H`: `local:H` with DANA-Zero's look-ahead (Hakimi et al. 2019, "Taming Momentum in a
  Distributed Asynchronous Environment", arXiv:1907.11612): the master keeps every worker's
  momentum v^j and sends θ̂ = θ - ημ·Σ_j v^j, θ moved by the momentum part of every worker's next
  update, its own included (one worker: Nesterov). With AdamW workers and windows of H steps, worker
  i's window starts at θ + Σ_{j≠i} u_j(H) + u_i(1), u_j(H) what worker j's AdamW moves θ over its
  next H steps on its momentum alone (DanaLookAhead): the others' next windows land before i's
  commit, its own steps after the first it takes itself. The update is added to θ in full.

`dn:H` is also DN+DyLU (Liu et al. 2024, Eq. 6): DyLU gives worker i H_i = ⌊v_i / v_max · H⌋ local
steps, v the workers' speeds, and N equal workers in turn all take H.

`--workers` sets N (4); `--fresh` starts every window at the newest θ instead of the worker's last
reply: the same turns without staleness, what asynchrony costs measured by its absence.
`--seed` takes one seed or several: every variant runs at each (the replay is deterministic per
seed), and the output and `--json` record give each variant's last held-out loss over the seeds as
their mean and its standard error; comparing two settings paired by seed is two such runs.

The model is gemps_worker.models.CharGpt at nanoGPT's shape scaled down (4 layers, 4 heads, width
96: 0.46M parameters; pre-norm blocks, GELU, tied embeddings, GPT-2's initialisation; no dropout),
AdamW as nanoGPT's configure_optimizers builds it (betas 0.9/0.99, weight decay 0.1 on matrices).
`--model user` replays the setting a new user tried from the guide (issue 78): nanoGPT scaled to 2
layers of width 128 (4 heads, 0.42M parameters) at batch 32 a worker. `--model comparison` replays
the comparison's character LM instead (gemps_bench.alternatives'
charlm: CharGpt with 6 layers of width 128, 1.2M parameters) with its workers' local optimizer
(torch.optim.Adam at the given rate, no weight decay).

    python scripts/adam_staleness.py --variants single stale:3 mean:4 local:1 --samples 12800 \\
        --json docs/results/adam/staleness.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from adam_look_ahead import DanaLookAhead  # beside this script (its directory is on sys.path when run)
from adam_replay_data import Data, flat, gradient, load
from adam_replay_options import WORKERS, parsed
from adam_rounds import rounds_adam, rounds_local

from gemps.pytorch.job_betas import JobBetas
from gemps.pytorch.look_ahead import LookAhead
from gemps_server.domain.rules.adaptive_staleness import AdaptiveStalenessRule
from gemps_server.domain.rules.base import CommitRule, StepContext
from gemps_server.domain.rules.delayed_nesterov import DelayedNesterovRule
from gemps_server.domain.rules.gem import GemRule


def server_adam(
    data: Data,
    variant: str,
    amount: int,
    steps: int,
    lr: float,
    evals: list[int],
    dc_lambda: float = 0.0,
    warmup: int | None = None,
    workers: int = WORKERS,
    prediction: float = 1.0,
    stop: int | None = None,
) -> list[list[float]]:
    """`single`, `stale:S`, `dc:S`, `mean:K`, `pred:K` and `ddp:K`: one AdamW holds θ; workers hand it
    gradients. `prediction` is pred:K's share of the move it predicts; `stop` as local_adam's."""
    central, worker = data.build(), data.build()
    optimizer = data.optimizer_of(central, lr)
    batched = variant in ("mean", "pred", "ddp")  # one step per `amount` gradients
    schedule = data.schedule_of(optimizer, steps // (amount if batched else 1), warmup)
    world = 1 if variant == "single" else workers
    streams = [data.batches(rank, world) for rank in range(world)]
    history = collections.deque([flat(central)], maxlen=amount + 1)  # stale:S, θ of the last S+1 versions
    replied = [history[0]] * world  # mean:K and pred:K, the θ each worker last received
    # pred:K: θ before the newest server step, and for each worker θ before its reply's, the server
    # steps before its reply and how many landed between its previous reply and its previous commit.
    before, server_steps = history[0], 0
    replied_before, replied_at, lags = [before] * world, [0] * world, [0] * world
    summed: list[torch.Tensor] = []
    mean_square: list[torch.Tensor] = []
    curve = []
    for step in range(1, (stop or steps) + 1):
        rank = step % world
        at = {"mean": replied[rank], "pred": replied[rank], "ddp": history[-1]}.get(variant, history[0])
        if variant == "pred":
            lead = prediction * lags[rank]
            if lead:
                at = at + lead * (at - replied_before[rank])
            lags[rank] = server_steps - replied_at[rank]
        grads = gradient(worker, at, next(streams[rank]))
        if variant == "dc":
            moved = history[-1] - at
            square = [g * g for g in grads]
            mean_square = (
                square if not mean_square else [0.95 * m + 0.05 * q for m, q in zip(mean_square, square, strict=True)]
            )
            grads = [
                g + dc_lambda * q * d.view_as(g) / (m.sqrt() + 1e-12)
                for g, q, m, d in zip(grads, square, mean_square, _split(moved, grads), strict=True)
            ]
        summed = grads if not summed else [a + g for a, g in zip(summed, grads, strict=True)]
        if not batched or step % amount == 0:
            scale = amount if batched else 1
            for p, g in zip(central.parameters(), summed, strict=True):
                p.grad = g / scale
            before = history[-1]
            optimizer.step()
            if schedule is not None:
                schedule.step()
            summed, server_steps = [], server_steps + 1
        history.append(flat(central))
        replied[rank], replied_before[rank], replied_at[rank] = history[-1], before, server_steps
        if step in evals:
            curve.append([step * data.batch, data.held_out(worker, history[-1])])
    return curve


def _split(vector: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`vector` cut into pieces the sizes of `like`'s tensors, in order."""
    return list(torch.split(vector, [t.numel() for t in like]))


def local_adam(
    data: Data,
    window: int,
    steps: int,
    lr: float,
    evals: list[int],
    outer: CommitRule | None = None,
    warmup: int | None = None,
    ahead: float = 0.0,
    job_betas: bool = False,
    workers: int = WORKERS,
    scale: float = 1.0,
    fresh: bool = False,
    dana: bool = False,
    stop: int | None = None,
) -> list[list[float]]:
    """`local:H`: each worker its own AdamW for H steps; the window's update added to θ in full,
    or (`dn:H`, `gem:H`) times `scale` handed to `outer`, the server's rule. `ahead` (`ahead:H`):
    each window starts `ahead` of θ's expected move past the reply, as LocalSteps' look_ahead does
    (its own code, gemps.pytorch.look_ahead); `job_betas` (`job:H`): with each worker's β1 kept to
    the job's pace, as LocalSteps' job_betas does (gemps.pytorch.job_betas). `dana` (`dana:H`): each
    window starts at DANA's look-ahead (DanaLookAhead). `fresh`: each window starts at the newest θ.
    `stop`: end after this many of the `steps` the schedules are planned for (a read early in a long run)."""
    models = [data.build() for _ in range(workers)]
    optimizers = [data.optimizer_of(model, lr) for model in models]
    # Each worker runs nanoGPT's schedule over its own share of the steps, as its own train.py would.
    schedules = [data.schedule_of(o, steps // workers, warmup) for o in optimizers]
    streams = [data.batches(rank, workers) for rank in range(workers)]
    theta, probe = flat(models[0]), data.build()
    for rank in range(workers):
        if outer is not None:  # each registers at θ0, as on a server
            outer.add_worker(f"worker-{rank}", theta.numpy().copy())
    starts = [theta] * workers  # where each worker's window starts: its last reply (or ahead of it)
    based = [0] * workers  # the version each worker's window started from
    aheads = [LookAhead(ahead) for _ in range(workers)]
    paces = [JobBetas(job_betas, optimizer.param_groups) for optimizer in optimizers]
    dana_ahead = DanaLookAhead(theta, workers, window) if dana else None
    curve, step, version = [], 0, 0
    while step < (stop or steps):
        for rank, (model, optimizer, schedule) in enumerate(zip(models, optimizers, schedules, strict=True)):
            start = theta if fresh else starts[rank]
            load(model, start)
            for _ in range(window):
                inputs, targets = next(streams[rank])
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                if schedule is not None:
                    schedule.step()
                step += 1
                if step in evals:
                    curve.append([step * data.batch, data.held_out(probe, theta)])
            delta = flat(model) - start
            staleness, version = version - based[rank], version + 1  # commits since its window's start
            theta = theta + delta if outer is None else _outer_step(outer, theta, delta * scale, rank, staleness)
            starts[rank], based[rank] = aheads[rank].start(theta, version, staleness), version
            if dana_ahead is not None:
                starts[rank] = dana_ahead.start(theta, rank, model, optimizer)
            paces[rank].after_commit(staleness)
    return curve


def _outer_step(rule: CommitRule, theta: torch.Tensor, delta: torch.Tensor, rank: int, staleness: int) -> torch.Tensor:
    """θ after the server's rule applies one worker's window (copies both ways: the rule reuses
    the θ it returned last as scratch)."""
    updated, _ = rule.step_scaled(theta.numpy().copy(), delta.numpy(), 1.0, StepContext(f"worker-{rank}", staleness))
    return torch.from_numpy(updated.copy())


def main() -> None:
    args = parsed(__doc__)
    torch.set_num_threads(1)
    results, batch = [], 0
    for seed in args.seed:
        data = Data(args.model, seed, args.beta1, args.beta2, args.schedule, args.batch, args.weight_decay)
        batch = data.batch
        for variant in args.variants:
            started = time.monotonic()
            curve = _curve(args, data, variant)
            results.append({"variant": variant, **_settings(args, variant, seed), "curve": curve})
            print(f"{variant:>10}: held-out loss {curve[-1][1]:.4f} after {curve[-1][0]:,} samples, seed {seed} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    summary = seeds_summary(results) if len(args.seed) > 1 else {}
    for variant, figures in summary.items():
        print(f"{variant:>10}: mean held-out loss {figures['mean']:.4f} ± {figures['standard_error']:.4f} "
              f"(standard error) over seeds {' '.join(map(str, figures['seeds']))}", flush=True)  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "batch": batch,
            "workers": args.workers,
            "results": results,
            **({"summary": summary} if summary else {}),
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


def seeds_summary(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each variant's last held-out loss over its seeds: their mean and its standard error."""
    finals: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for result in results:
        finals[result["variant"]].append((result["seed"], result["curve"][-1][1]))
    summary = {}
    for variant, read in finals.items():
        losses = [loss for _, loss in read]
        error = statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else 0.0
        summary[variant] = {
            "seeds": [seed for seed, _ in read],
            "mean": statistics.fmean(losses),
            "standard_error": error,
        }
    return summary


def _curve(args: argparse.Namespace, data: Data, variant: str) -> list[list[float]]:
    """One variant's held-out losses, [samples, loss] at each evaluation, on `data`'s seed."""
    name, _, amount = variant.partition(":")
    steps = args.samples // data.batch
    evals = [steps * (i + 1) // args.evaluations for i in range(args.evaluations)]
    stop = None if args.stop_at is None else args.stop_at // data.batch
    windows = {"warmup": args.warmup, "workers": args.workers, "fresh": args.fresh}
    if name in ("local", "ahead", "job", "dana"):
        factor, job = (args.ahead if name in ("ahead", "job") else 0.0), name == "job"
        return local_adam(
            data,
            int(amount),
            steps,
            args.learning_rate,
            evals,
            ahead=factor,
            job_betas=job,
            dana=name == "dana",
            stop=stop,
            **windows,
        )
    if name in ("dn", "gem", "as"):
        outer, scale = _rule(name, args, data), args.gem_outer if name == "gem" else 1.0
        return local_adam(data, int(amount), steps, args.learning_rate, evals, outer, scale=scale, **windows)
    if name in ("single", "stale", "dc", "mean", "pred", "ddp"):
        amounts = int(amount or 0), steps, args.learning_rate, evals
        return server_adam(data, name, *amounts, args.dc_lambda, args.warmup, args.workers, args.prediction, stop=stop)
    if name == "rounds":
        return rounds_adam(data, int(amount), steps, args.learning_rate, evals, args.warmup, args.workers)
    if name == "windows":
        return rounds_local(
            data, int(amount), steps, args.learning_rate, evals, args.warmup, args.workers,
            {"outer_rate": args.outer_rate, "outer_momentum": args.outer_momentum}, stop,
            None if args.beta1_to is None else (args.beta1_to, args.beta1_ramp), args.round_momentum,
        )  # fmt: skip
    raise ValueError(f"unknown variant {variant!r}")  # parsed() refuses it first


def _settings(args: argparse.Namespace, variant: str, seed: int) -> dict[str, Any]:
    """What a variant's run was given, as its record keeps it."""
    name = variant.partition(":")[0]
    settings = {
        "model": args.model,
        "seed": seed,
        "learning_rate": args.learning_rate,
        "dc_lambda": args.dc_lambda,
        "warmup": args.warmup,
        "workers": args.workers,
        "fresh": args.fresh,
        **({} if args.beta1 is None else {"beta1": args.beta1}),
        **({} if args.beta2 is None else {"beta2": args.beta2}),
        **({} if args.schedule == "cosine" else {"schedule": args.schedule}),
        **({} if args.batch is None else {"batch": args.batch}),
        **({} if args.weight_decay is None else {"weight_decay": args.weight_decay}),
        **({} if args.stop_at is None else {"stop_at": args.stop_at}),
    }
    if name == "dn":
        settings.update(dn_learning_rate=args.dn_learning_rate, dn_momentum=args.dn_momentum)
    if name == "windows":
        settings.update(outer_rate=args.outer_rate, outer_momentum=args.outer_momentum)
        if args.beta1_to is not None:
            settings.update(beta1_to=args.beta1_to, beta1_ramp=args.beta1_ramp)
        if args.round_momentum:
            settings.update(round_momentum=True)
    if name == "pred":
        settings.update(prediction=args.prediction)
    if name in ("ahead", "job"):
        settings.update(ahead=args.ahead)
    if name == "gem":
        settings.update(
            gem_outer=args.gem_outer,
            gem_momentum=args.gem_momentum,
            gem_kappa=args.gem_kappa,
            gem_pi_max=args.gem_pi_max,
            gem_own_step=args.gem_own_step,
        )
    return settings


def _rule(name: str, args: argparse.Namespace, data: Data) -> CommitRule:
    """dn:H's, as:H's or gem:H's outer rule, the server's own code, over the model's parameters."""
    size = sum(p.numel() for p in data.build().parameters())
    if name == "as":
        return AdaptiveStalenessRule(size, learning_rate=1.0)
    if name == "gem":
        return GemRule(
            size,
            learning_rate=1.0,
            momentum=args.gem_momentum,
            kappa=args.gem_kappa,
            pi_max=args.gem_pi_max,
            own_step=args.gem_own_step,
        )
    return DelayedNesterovRule(
        size,
        learning_rate=1.0,
        dn_learning_rate=args.dn_learning_rate,
        momentum=args.dn_momentum,
        nesterov_period=args.workers,
        momentum_activation=0.0,
    )


if __name__ == "__main__":
    main()
