"""The server's `adamw` rule in the AdamW replay's `rounds:K` (scripts/adam_staleness.py, which
imports it from beside itself): N equal workers in turn, each gradient taken on the θ its round
started from (what the SDK's wait for the round gives them), applied by the rule's own code with
the server's own learning-rate schedule (gemps_proto.schedules), as a user would run it:

    gemps server --rule adamw --learning-rate LR --adam-beta2 0.99 --adam-weight-decay 0.1 \\
        --round-size K --lr-schedule warmup-cosine --lr-warmup-commits (W+1)*K --lr-total-commits STEPS \\
        --lr-min LR/10

(W nanoGPT's warm-up steps, STEPS the run's commits). The rule decays the matrices alone, as nanoGPT's
AdamW, which `ddp:K` runs, does. The comparison's model (`--model comparison`: Adam, no
decay) at a constant rate is `ddp:K`'s computation, to float32's rounding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from gemps_proto.schema import ParameterSpec, TrainingConfig
from gemps_server.domain.rules import create_rule
from gemps_server.domain.rules.base import StepContext


class Replayed(Protocol):
    """What the replay's Data gives (scripts/adam_staleness.py)."""

    batch: int

    def build(self) -> torch.nn.Module: ...
    def optimizer_of(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer: ...
    def batches(self, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def held_out(self, model: torch.nn.Module, theta: torch.Tensor) -> float: ...


Gradient = Callable[[torch.nn.Module, torch.Tensor, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]


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
    data: Replayed,
    gradient: Gradient,
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
    theta = torch.nn.utils.parameters_to_vector(central.parameters()).detach().numpy().copy()
    rule = create_rule(server_schedule(lr, round_size, steps, warmup, betas, decay), theta.size)
    spec = [ParameterSpec(name, tuple(p.shape)) for name, p in central.named_parameters()]
    rule.take_spec(spec, (0, theta.size))  # as the server does: the decay on the matrices alone
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
