"""The server's `adamw` rule in the AdamW replay's `rounds:K` (scripts/adam_staleness.py, which
imports it from beside itself): N equal workers in turn, each gradient taken on the θ its round
started from (what the SDK's wait for the round gives them), applied by the rule's own code with
the server's own learning-rate schedule (gemps_proto.schedules), as a user would run it:

    gemps server --rule adamw --learning-rate LR --adam-beta2 0.99 --adam-weight-decay 0.1 \\
        --round-size K --lr-schedule warmup-cosine --lr-warmup-commits (W+1)*K --lr-total-commits STEPS \\
        --lr-min LR/10

(W nanoGPT's warm-up steps, STEPS the run's commits). The rule decays the matrices alone, as nanoGPT's
AdamW, which `ddp:K` runs, does. The comparison's model (`--model comparison`: Adam, no
decay) at a constant rate is `ddp:K`'s computation, to float32's rounding.

`windows:H` is the same rule over rounds of local steps: each worker's window of H AdamW steps from
the round's θ, committed as an update, the round closing with DiLoCo's outer Nesterov step on their
mean (r 1, μ 0: θ + their mean):

    gemps server --rule adamw --outer-rate R --outer-momentum MU     (workers: LocalSteps(..., steps=H))"""

from __future__ import annotations

import torch
from adam_replay_data import Data, flat, gradient, load

from gemps.pytorch import Beta1Ramp
from gemps.pytorch.round_momentum import set_from_move
from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig
from gemps_server.domain.rules import create_rule
from gemps_server.domain.rules.base import CommitRule, StepContext


def server_schedule(
    lr: float, round_size: int, steps: int, warmup: int | None, betas: tuple[float, float], decay: float
) -> TrainingConfig:
    """The server's config for `rounds:K`: the `adamw` rule at the model's betas, nanoGPT's warm-up
    of `warmup` steps and its cosine after it to a tenth of the rate at the run's `steps` commits
    (constant without a warm-up). nanoGPT's warm-up rises as (s + 1)/(W + 1) at step s; the server's,
    (v + 1)/W' at version v, is that at each round's closing commit (v = K(s + 1) - 1) with W' = (W + 1)K.
    A warm-up of W·K commits reaches the top one round early, which at 3e-3 ended 0.6-7.2 % above
    DDP where (W + 1)K ended 0.0-0.4 % above (docs/RESULTS.md)."""
    options = {"adam_beta1": betas[0], "adam_beta2": betas[1], "adam_weight_decay": decay, "round_size": round_size}
    if warmup is None:
        return TrainingConfig(rule="adamw", learning_rate=lr, rule_options=options)
    return TrainingConfig(
        rule="adamw",
        learning_rate=lr,
        rule_options=options,
        lr_schedule="warmup-cosine",
        lr_warmup_commits=(warmup + 1) * round_size,  # nanoGPT's (s + 1)/(W + 1) at each round's close
        lr_total_commits=steps,
        lr_min=lr / 10,
    )


def rounds_adam(
    data: Data,
    round_size: int,
    steps: int,
    lr: float,
    evals: list[int],
    warmup: int | None,
    workers: int,
) -> list[list[float]]:
    """rounds:K's curve: held-out loss at each of `evals` (commits), as [samples, loss], at the betas
    and the weight decay of the model's optimizer (the largest of its groups')."""
    central, worker = data.build(), data.build()
    groups = data.optimizer_of(central, lr).param_groups
    betas, decay = groups[0]["betas"], max(group["weight_decay"] for group in groups)
    theta = flat(central).numpy().copy()
    rule = _rule_of(central, server_schedule(lr, round_size, steps, warmup, betas, decay))
    streams = [data.batches(rank, workers) for rank in range(workers)]
    round_start, curve = 0, []
    for step in range(1, steps + 1):
        rank = step % workers
        grads = gradient(worker, torch.from_numpy(theta), next(streams[rank]))
        payload = torch.cat([g.reshape(-1) for g in grads]).numpy()
        context = StepContext(f"worker-{rank}", staleness=step - 1 - round_start, version=step - 1)
        theta, stats = rule.step(theta, payload, context)
        if not stats.pending:  # θ moved: the next round's gradients are taken on it
            round_start = step
        if step in evals:
            curve.append([step * data.batch, data.held_out(worker, torch.from_numpy(theta.copy()))])
    return curve


def _rule_of(model: torch.nn.Module, config: TrainingConfig) -> CommitRule:
    """The server's rule for `model`'s θ, told its spec as the server tells it (the decay on the
    matrices alone)."""
    size = sum(p.numel() for p in model.parameters())
    rule = create_rule(config, size)
    rule.take_spec([ParameterSpec(name, tuple(p.shape)) for name, p in model.named_parameters()], (0, size))
    return rule


def rounds_local(
    data: Data,
    window: int,
    steps: int,
    lr: float,
    evals: list[int],
    warmup: int | None,
    workers: int,
    outer: dict[str, float],
    stop: int | None = None,
    beta1_ramp: tuple[float, float] | None = None,
    round_momentum: bool = False,
) -> list[list[float]]:
    """`windows:H`: rounds of the N workers' windows of H local AdamW steps, each from the θ its
    round started at (each worker its own moments, and nanoGPT's schedule over its own share of the
    steps, as LocalSteps' workers run), committed as updates; the rule's round closes at the N-th
    with `outer`'s outer_rate and outer_momentum (DiLoCo's outer Nesterov step on their mean).
    Held-out loss at each round's close once an evaluation point is passed, as [samples, loss]
    (the middle and the end fall on closes for whole rounds). `stop`: end after that many of the
    `steps` the schedules plan for. `round_momentum`: each worker's first moment set from the
    round's move after it closes (LocalSteps' round_momentum=True: gemps.pytorch.round_momentum)."""
    models = [data.build() for _ in range(workers)]
    optimizers = [data.optimizer_of(model, lr) for model in models]
    schedules = [data.schedule_of(o, steps // workers, warmup) for o in optimizers]
    ramps = None  # the windows recipe's β1, raised over the first `share` of each worker's steps
    if beta1_ramp is not None:
        to, share = beta1_ramp
        ramps = [Beta1Ramp(o, to, max(1, round(share * (steps // workers)))) for o in optimizers]
    streams = [data.batches(rank, workers) for rank in range(workers)]
    probe = data.build()
    rule = _rule_of(probe, TrainingConfig(rule="adamw", rule_options={"round_size": workers, **outer}))
    theta, step, version = flat(probe).numpy().copy(), 0, 0
    curve: list[list[float]] = []
    while step < (stop or steps):
        start = torch.from_numpy(theta.copy())
        for rank, (model, optimizer, schedule) in enumerate(zip(models, optimizers, schedules, strict=True)):
            load(model, start)
            for _ in range(window):
                inputs, targets = next(streams[rank])
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                if schedule is not None:
                    schedule.step()
                if ramps is not None:
                    ramps[rank].step()
                step += 1
            delta = (flat(model) - start).numpy()
            context = StepContext(f"worker-{rank}", staleness=rank, version=version, kind=PayloadKind.UPDATE)
            theta, _ = rule.step(theta, delta, context)
            version += 1
        if round_momentum:  # every worker waited for the round: its θ is each one's next start
            end = torch.from_numpy(theta.copy())
            for model, optimizer in zip(models, optimizers, strict=True):
                set_from_move(optimizer, list(model.parameters()), start, end, window)
        while len(curve) < len(evals) and evals[len(curve)] <= step:
            curve.append([step * data.batch, data.held_out(probe, torch.from_numpy(theta.copy()))])
    return curve
