"""Why a torch LR scheduler cannot drive `RemoteOptimizer`, and which server flags give its schedule.

The gemps server owns η: a gradient is applied as -η(v)·g, where v is the central version (the
commits applied, from every worker; gemps_proto.schedules). A torch scheduler counts its own
`scheduler.step()` calls, usually one per epoch of one worker, and writes `group["lr"]`: on a
shared server neither the count nor the write can mean the same thing, so translating it from a
worker is not exact. Instead `RemoteOptimizer`'s parameter group refuses `lr` to a scheduler
(reading it is the first thing every torch scheduler does at construction) and to any writer, with
`ServerOwnsLearningRateError`: the user reads, at the line that built the scheduler, that the server
owns the schedule and the `gemps server` flags that give the same one, computed from the
scheduler's arguments where gemps can express it. The unit those flags need is K, the commits all
workers make between two `scheduler.step()` calls, which only the user knows.

Code that only reads `lr` (a log line, Lightning's LearningRateMonitor, Hugging Face Trainer's
logs) gets the server's η at the version the model holds, as `RemoteOptimizer.learning_rate`, by
`group["lr"]` and by `group.get("lr")` alike; the group stores no `lr` (its keys, and a state dict,
stay `params` alone).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from gemps.errors import GempsError
from gemps_proto import schedules
from gemps_proto.schema import TrainingConfig

# The keys of a parameter group that a scheduler reads or writes for the learning rate.
LR_KEYS = frozenset({"lr", "initial_lr"})

# ReduceLROnPlateau is an LRScheduler since torch 2.2, not before.
_SCHEDULER_TYPES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

# How far up the stack a scheduler's __init__ may be from the group's read (ReduceLROnPlateau reads
# through a helper; `group.get` is one more frame): the frames between are torch's and the group's.
_FRAMES_TO_SCHEDULER = 5


class ServerOwnsLearningRateError(GempsError, TypeError):
    """A torch LR scheduler (or code reading or setting a group's `lr`) met `RemoteOptimizer`: the
    server owns the learning rate and its schedule. A TypeError, as torch's own refusal of an
    optimizer a scheduler cannot drive; the message names the `gemps server` flags to use."""


class ServerOwnedGroup(dict[str, Any]):
    """RemoteOptimizer's parameter group. Reading `lr` gives the server's η at the version the model
    holds, except to a torch scheduler being built; writing `lr` or `initial_lr`, a scheduler's
    reading them, and any reading of `initial_lr` raise ServerOwnsLearningRateError (instead of
    torch's KeyError, or a value the server would ignore)."""

    def __init__(
        self, group: dict[str, Any], config: Callable[[], TrainingConfig], learning_rate: Callable[[], float]
    ) -> None:
        super().__init__(group)
        self.config = config  # the server's, whose schedule the error names
        self.learning_rate = learning_rate  # η at the version the model holds

    def __missing__(self, key: str) -> Any:
        if key in LR_KEYS:
            scheduler = _scheduler_being_built()
            if key == "lr" and scheduler is None:
                return self.learning_rate()
            raise ServerOwnsLearningRateError(refusal(scheduler, self.config()))
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        """As `group[key]` for `lr` (dict.get never asks __missing__, and None would hide η)."""
        return self[key] if key == "lr" and key not in self else super().get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        if key in LR_KEYS:
            raise ServerOwnsLearningRateError(refusal(_scheduler_being_built(), self.config()))
        super().__setitem__(key, value)

    def setdefault(self, key: str, default: Any = None) -> Any:
        """Refused for `lr` and `initial_lr` as a write (dict.setdefault never calls __setitem__)."""
        if key in LR_KEYS and key not in self:
            raise ServerOwnsLearningRateError(refusal(_scheduler_being_built(), self.config()))
        return super().setdefault(key, default)

    def update(self, *others: Any, **values: Any) -> None:
        """Each key through __setitem__ (dict.update skips it), so `lr` is refused here too."""
        for key, value in dict(*others, **values).items():
            self[key] = value

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (torch.save of a state dict) as a plain dict
        return dict, (dict(self),)


def refusal(scheduler: object | None, config: TrainingConfig) -> str:
    """The error's message: the server owns η; the flags for `scheduler`'s schedule if one is being
    built (with K, the commits between two scheduler.step() calls, left to the user); what the
    server runs now."""
    now = f"This server runs: {' '.join(server_flags(config))}."
    if scheduler is None:
        return (
            "the gemps server owns the learning rate and its schedule: RemoteOptimizer has no group 'lr' "
            f"to read or set. {now} Set them with `gemps server --learning-rate ... --lr-schedule ...` "
            "(see `gemps server --help`); optimizer.learning_rate is η at the version the model holds."
        )
    name = type(scheduler).__name__
    flags, caveat = equivalent(scheduler)
    if flags is None:
        advice = (
            f"Remove the scheduler: gemps has no schedule like {name}'s{caveat}. The server's are constant, "
            "step (exponential decay too: --lr-step-size 1), cosine, each with an optional linear warm-up "
            "(`gemps server --help`)."
        )
    else:
        advice = (
            f"Remove the scheduler and start the server with its schedule:\n\n"
            f"    gemps server --learning-rate LR {' '.join(flags)}\n\n"
            "where LR is the lr your torch optimizer had and K the commits all workers together make between "
            "two scheduler.step() calls (for one call per epoch: the batches of one epoch, over every "
            f"worker){caveat}."
        )
    return (
        f"the gemps server owns the learning rate and its schedule: a torch {name} cannot drive "
        "RemoteOptimizer (the server's η follows the central version, the commits applied from every "
        f"worker, not this worker's scheduler.step() calls). {advice} {now}"
    )


def equivalent(scheduler: object) -> tuple[list[str] | None, str]:
    """The `gemps server` flags that give `scheduler`'s schedule in commits (None: gemps cannot
    express it), and a caveat on how close they are ("" or a clause starting with "; ")."""
    lr_scheduler = torch.optim.lr_scheduler
    if isinstance(scheduler, lr_scheduler.StepLR | lr_scheduler.ExponentialLR):
        step_size = getattr(scheduler, "step_size", 1)  # ExponentialLR: StepLR with a step of 1
        return _step(step_size, scheduler.gamma, "")
    if isinstance(scheduler, lr_scheduler.MultiStepLR):
        return _milestones(scheduler.milestones, scheduler.gamma)
    if isinstance(scheduler, lr_scheduler.CosineAnnealingLR):
        return [
            f"--lr-schedule {schedules.COSINE}",
            f"--lr-total-commits {_times_k(scheduler.T_max)}",
            f"--lr-min {scheduler.eta_min:g}",
        ], "; the server's cosine moves at every commit, and holds at --lr-min after T_max where torch's rises"
    if isinstance(scheduler, lr_scheduler.LinearLR):
        if scheduler.end_factor != 1:
            return None, f" (a linear decay to {scheduler.end_factor:g}·lr)"
        return [f"--lr-warmup-commits {_times_k(scheduler.total_iters)}"], (
            f"; the server's warm-up starts from LR/W rather than {scheduler.start_factor:g}·LR, and "
            "multiplies any --lr-schedule"
        )
    return None, ""


def _step(step_size: int, gamma: float, caveat: str) -> tuple[list[str] | None, str]:
    if not 0 < gamma <= 1:
        return None, f" (gamma {gamma:g}: the server's --lr-gamma is in (0, 1])"
    return [
        f"--lr-schedule {schedules.STEP}",
        f"--lr-step-size {_times_k(step_size)}",
        f"--lr-gamma {gamma:g}",
    ], caveat


def _milestones(milestones: Counter[int], gamma: float) -> tuple[list[str] | None, str]:
    """A step schedule when the milestones are every m epochs (m, 2m, 3m, ...): the same until the
    last, after which the server goes on decaying."""
    ordered = sorted(milestones.elements())
    first = ordered[0] if ordered else 0
    if first <= 0 or ordered != [first * (i + 1) for i in range(len(ordered))]:
        return None, f" (milestones {ordered}: the server's step schedule decays every S commits)"
    return _step(first, gamma, f"; the same until epoch {ordered[-1]}, where torch's decay stops, not the server's")


def _times_k(count: int) -> str:
    """A count of scheduler.step() calls in commits: K of them each."""
    return "<K>" if count == 1 else f"<{count}*K>"


def server_flags(config: TrainingConfig) -> list[str]:
    """The `gemps server` flags of the schedule the server announced."""
    flags = [f"--learning-rate {config.learning_rate:g}", f"--lr-schedule {config.lr_schedule or schedules.CONSTANT}"]
    if config.lr_schedule == schedules.STEP:
        flags += [f"--lr-step-size {config.lr_step_size}", f"--lr-gamma {config.lr_gamma:g}"]
    elif config.lr_schedule == schedules.COSINE:
        flags += [f"--lr-total-commits {config.lr_total_commits}", f"--lr-min {config.lr_min:g}"]
    if config.lr_warmup_commits > 0:
        flags.append(f"--lr-warmup-commits {config.lr_warmup_commits}")
    return flags


def _scheduler_being_built() -> object | None:
    """The torch scheduler whose construction is touching the group, if any: its arguments are
    already set on it (torch's schedulers set them before LRScheduler.__init__ reads `lr`), and
    nothing else hands it to us."""
    frame = inspect.currentframe()
    for _ in range(_FRAMES_TO_SCHEDULER + 2):  # this function's frame and the group's, then torch's
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _SCHEDULER_TYPES):
            return candidate
        frame = frame.f_back
    return None
