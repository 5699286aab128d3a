"""The TrainingArguments a Hugging Face Trainer holds that do not train with gemps, said once.

Given `optimizers=(RemoteOptimizer, ServerSchedule)`, the Trainer builds neither an optimizer nor
a schedule, so its `learning_rate`, `lr_scheduler_type`, `warmup_*`, `weight_decay` and the AdamW
settings are ignored, by the Trainer, without a word: a user who set `learning_rate=5e-5` trains
at the server's η instead. Nothing hands gemps the Trainer's arguments, but the Trainer is the
caller of the schedule's first `step()`: ServerSchedule looks for it up the stack there (as
gemps.pytorch.schedules looks for a scheduler being built) and logs one WARNING naming each such
argument that differs from what gemps applies, and where gemps sets it instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from typing import Any

from gemps.pytorch.refusals import rule_weight_decay
from gemps_proto.schema import TrainingConfig

log = logging.getLogger("gemps.pytorch")

# How far up the stack the Trainer may be from ServerSchedule.step (accelerate's scheduler wrapper
# is between them).
_FRAMES_TO_TRAINER = 6

# The arguments the Trainer hands its own schedule, which it does not build with ServerSchedule.
_SCHEDULE = ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio")
# The arguments of the optimizer it would build.
_OPTIMIZER = ("optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon")


def trainer_arguments() -> Any | None:
    """The TrainingArguments of the Hugging Face Trainer up the stack, if one is (None otherwise)."""
    transformers = sys.modules.get("transformers")
    kind = getattr(transformers, "TrainingArguments", None) if transformers is not None else None
    if kind is None:
        return None
    frame = inspect.currentframe()
    for _ in range(_FRAMES_TO_TRAINER + 2):
        if frame is None:
            return None
        arguments = getattr(frame.f_locals.get("self"), "args", None)
        if isinstance(arguments, kind):
            return arguments
        frame = frame.f_back
    return None


def unused(arguments: Any, config: TrainingConfig, weight_decay: float) -> list[str]:
    """What of `arguments` (TrainingArguments) does not train under gemps, each with what does."""
    defaults = {field.name: _default(field) for field in dataclasses.fields(arguments)}
    said = []
    if arguments.learning_rate != config.learning_rate:
        said.append(
            f"learning_rate={arguments.learning_rate:g}: the gemps server's is {config.learning_rate:g} "
            "(`gemps server --learning-rate`; the Trainer logs the server's η)"
        )
    applied = rule_weight_decay(config)  # the server rule's own decoupled decay (adamw's), if any
    if applied is not None and arguments.weight_decay != applied:
        said.append(
            f"weight_decay={arguments.weight_decay:g}: the server's rule {config.rule} applies AdamW's decoupled "
            f"weight decay, {applied:g} (`gemps server --adam-weight-decay`)"
        )
    elif applied is None and arguments.weight_decay != weight_decay:
        said.append(
            f"weight_decay={arguments.weight_decay:g}: RemoteOptimizer(model, address, weight_decay=...) applies "
            f"it ({weight_decay:g} now)"
        )
    changed = [name for name in _SCHEDULE if hasattr(arguments, name) and getattr(arguments, name) != defaults[name]]
    if changed:
        listed = ", ".join(f"{name}={getattr(arguments, name)!r}" for name in changed)
        said.append(f"{listed}: the schedule is the server's (`gemps server --lr-schedule`, --lr-warmup-commits, ...)")
    changed = [name for name in _OPTIMIZER if hasattr(arguments, name) and getattr(arguments, name) != defaults[name]]
    if changed:
        listed = ", ".join(f"{name}={getattr(arguments, name)!r}" for name in changed)
        said.append(f"{listed}: the update rule is the server's (`gemps server --rule`)")
    return said


def warn_unused(config: TrainingConfig, weight_decay: float) -> None:
    """A WARNING naming the Trainer's arguments that gemps does not use, when a Trainer is up the stack."""
    arguments = trainer_arguments()
    said = [] if arguments is None else unused(arguments, config, weight_decay)
    if said:
        log.warning(
            "gemps: the Trainer's TrainingArguments are not what trains (given optimizers=(RemoteOptimizer, "
            "ServerSchedule), the Trainer builds neither an optimizer nor a schedule): %s",
            "; ".join(said),
        )


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None
