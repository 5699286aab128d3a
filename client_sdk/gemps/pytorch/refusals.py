"""What RemoteOptimizer refuses of a torch optimizer's arguments, each refusal naming what gemps
does instead (issue 60: a new user's first hour).

A training script that swaps `torch.optim.AdamW(...)` for `RemoteOptimizer(...)` brings the torch
optimizer's arguments along: parameter groups (nanoGPT's `configure_optimizers` gives two, one with
weight decay and one without), `lr=`, `betas=`, `momentum=`. The server owns the learning rate,
its schedule and the update rule; weight decay is the worker's (RemoteModel's `weight_decay`),
except under a rule that applies AdamW's decoupled decay itself (adamw: `--adam-weight-decay`).
Each such argument is refused with a TypeError that says where its setting lives, rather than
Python's "unexpected keyword argument" from deep inside gemps.Client, or a silent default.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from gemps_proto.schema import TrainingConfig

# Where each torch optimizer setting lives with gemps.
_SERVER_RULE = (
    "the server's update rule owns it (`gemps server --rule`, and its options: `gemps server --help`); to train "
    "with your own Adam(W) and its settings, take local steps with it: gemps.pytorch.LocalSteps(model, "
    "torch.optim.AdamW(...), address)"
)
# AdamW's own settings: the server's adamw rule takes them.
_SERVER_ADAM = (
    "the server's update rule owns it (`gemps server --rule`, and its options: `gemps server --help`): "
    "`gemps server --rule adamw --adam-beta1 0.9 --adam-beta2 0.999 --adam-epsilon 1e-8` runs AdamW on the "
    "server, one step on each round of the workers' gradients (DDP-AdamW's computation); or keep your own "
    "Adam(W) for local steps: gemps.pytorch.LocalSteps(model, torch.optim.AdamW(...), address)"
)
_ELSEWHERE = {
    "lr": "the server owns the learning rate: `gemps server --learning-rate` (its schedule: --lr-* flags)",
    "learning_rate": "the server owns the learning rate: `gemps server --learning-rate` (its schedule: --lr-* flags)",
    "momentum": "the server's rule applies the momentum: `gemps server --momentum` (GEM's mu)",
    "betas": _SERVER_ADAM,
    "eps": _SERVER_ADAM,
    "amsgrad": _SERVER_RULE,
    "nesterov": "`gemps server --rule nesterov`",
    "dampening": _SERVER_RULE,
    "foreach": "the server applies the update: there is no torch kernel to choose",
    "fused": "the server applies the update: there is no torch kernel to choose",
    "capturable": "the server applies the update: there is no torch kernel to choose",
    "maximize": "negate the loss instead: the server descends the gradient it is sent",
}

WEIGHT_DECAY_WHERE = (
    "weight decay is the worker's: RemoteOptimizer(model, address, weight_decay=0.1) adds 0.1·θ to the gradient "
    "of every trained parameter before it is committed (torch.optim.SGD's weight_decay), so the server's learning "
    "rate, its schedule and GEM's π scale it with the gradient (it is not AdamW's decoupled decay)"
)


def refuse_not_a_model(model: object) -> None:
    """TypeError unless `model` is a torch.nn.Module, saying what to give instead of what was given."""
    if isinstance(model, torch.nn.Module):
        return
    groups = _parameter_groups(model)
    if groups:
        settings = sorted({key for group in groups for key in group if key != "params"})
        listed = f" (with {', '.join(settings)})" if settings else ""
        raise TypeError(
            f"RemoteOptimizer takes the model itself (its buffers travel too), not parameter groups{listed}: it "
            "trains one group, every parameter of the model that requires grad, whose update the gemps server "
            "owns. Give RemoteOptimizer(model, address), or keep your optimizer and its groups for local steps: "
            "gemps.pytorch.LocalSteps(model, optimizer, address). With RemoteOptimizer the learning rate "
            "and its schedule are the server's "
            f"(`gemps server --learning-rate`, --lr-* flags), and {WEIGHT_DECAY_WHERE}. To leave a parameter "
            "untrained, set its requires_grad=False."
        )
    raise TypeError(
        "RemoteOptimizer takes the model itself (its buffers travel too), not "
        f"{type(model).__name__ if not isinstance(model, Iterable) else 'model.parameters()'}: "
        "RemoteOptimizer(model, address)"
    )


def refuse_optimizer_options(options: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """TypeError naming, for each of `options` not in `accepted` (RemoteModel's and gemps.Client's
    keywords), where gemps sets it, or that it is not an option at all."""
    unknown = [key for key in options if key not in set(accepted)]
    if not unknown:
        return
    known = [f"{key}: {_ELSEWHERE[key]}" for key in unknown if key in _ELSEWHERE]
    others = [key for key in unknown if key not in _ELSEWHERE]
    said = "; ".join(known)
    if others:
        said += ("; " if said else "") + (
            f"{', '.join(others)}: not an option of RemoteOptimizer, RemoteModel or gemps.Client "
            "(RemoteOptimizer(model, address, **options) takes threads=, process_group=, weight_decay= and "
            "gemps.Client's keywords)"
        )
    raise TypeError(f"RemoteOptimizer does not take a torch optimizer's {', '.join(unknown)}: {said}")


def keywords(*functions: Any) -> set[str]:
    """The keyword parameters of `functions` (what RemoteOptimizer passes its options on to)."""
    return {
        name
        for function in functions
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD) and name != "self"
    }


#: the option of a server rule that applies AdamW's decoupled weight decay itself (rule adamw)
RULE_WEIGHT_DECAY = "adam_weight_decay"


def rule_weight_decay(config: TrainingConfig) -> float | None:
    """The decoupled weight decay the server's rule applies itself (adamw's); None for the rules
    that apply none, under which weight decay is the worker's (RemoteOptimizer's weight_decay=)."""
    value = config.rule_options.get(RULE_WEIGHT_DECAY)
    return None if value is None else float(value)


def refuse_weight_decay_twice(config: TrainingConfig, weight_decay: float) -> None:
    """ValueError when the worker's `weight_decay` would add L2 decay to its gradients while the
    server's rule applies AdamW's decoupled decay: a user who gave it meant AdamW's."""
    applied = rule_weight_decay(config)
    if weight_decay and applied is not None:
        raise ValueError(
            f"weight_decay={weight_decay:g}: the server's rule {config.rule} applies AdamW's decoupled weight decay "
            f"itself, {applied:g} now (`gemps server --adam-weight-decay`); RemoteOptimizer's weight_decay would add "
            f"{weight_decay:g}·θ to each gradient on top (L2 decay, which Adam scales per parameter). Leave "
            "weight_decay at 0 and set the server's"
        )


def check_weight_decay(weight_decay: float) -> float:
    """`weight_decay` as a float; ValueError naming it unless a finite number >= 0."""
    try:
        value = float(weight_decay)
    except (TypeError, ValueError):
        raise ValueError(f"weight_decay must be a number >= 0, not {weight_decay!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"weight_decay must be a finite number >= 0, not {weight_decay!r}")
    return value


def _parameter_groups(value: object) -> list[Mapping[str, Any]]:
    """`value` as torch optimizer parameter groups (a list of dicts with "params"), else []."""
    if not isinstance(value, list | tuple) or not value:
        return []
    if all(isinstance(group, Mapping) and "params" in group for group in value):
        return list(value)
    return []
