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

Code that only reads `lr` (a log line, Lightning's LearningRateMonitor) gets the server's η at the
version the model holds, as `RemoteOptimizer.learning_rate`, by `group["lr"]` and by
`group.get("lr")` alike; the group stores no `lr` (its keys, and a state dict, stay `params` alone).

A framework that must hold a scheduler gets `ServerSchedule(optimizer)`: a torch LRScheduler that
sets nothing and whose `get_last_lr()` is that η. Hugging Face's Trainer builds its own (a LambdaLR,
linear decay by default) when given `optimizers=(optimizer, None)`; that one is refused like any
other, with a message that names `optimizers=(optimizer, ServerSchedule(optimizer))`.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from gemps.errors import GempsError
from gemps.pytorch.refusals import rule_weight_decay
from gemps.pytorch.trainer_arguments import warn_unused
from gemps_proto import schedules
from gemps_proto.schema import TrainingConfig

# The keys of a parameter group that a scheduler reads or writes for the learning rate.
LR_KEYS = frozenset({"lr", "initial_lr"})

# The group settings the server owns besides η, and where each is set.
_SETTINGS = {
    "momentum": "`gemps server --momentum`",
    "weight_decay": "the server applies no weight decay: the worker does, "
    "RemoteOptimizer(model, address, weight_decay=...)",
}

# ReduceLROnPlateau is an LRScheduler since torch 2.2, not before.
_SCHEDULER_TYPES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

# How far up the stack a scheduler's __init__ may be from the group's read (ReduceLROnPlateau reads
# through a helper; `group.get` is one more frame): the frames between are torch's and the group's.
_FRAMES_TO_SCHEDULER = 5


class ServerOwnsLearningRateError(GempsError, TypeError):
    """A torch LR scheduler (or code reading or setting a group's `lr`) met `RemoteOptimizer`: the
    server owns the learning rate and its schedule. A TypeError, as torch's own refusal of an
    optimizer a scheduler cannot drive; the message names the `gemps server` flags to use."""


def server_setting(key: str, config: TrainingConfig, weight_decay: float = 0.0) -> float | None:
    """What is applied for a torch group setting other than `lr` (None: not one it knows):
    `momentum` is the server rule's μ (0 for rules without one), `weight_decay` the server rule's
    decoupled decay where it applies one (adamw's), else the worker's (RemoteOptimizer's
    `weight_decay=`). Lightning's LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    reads them."""
    if key == "momentum":
        return config.rule_options.get("momentum", 0.0)  # the option of rules with a momentum
    if key != "weight_decay":
        return None
    applied = rule_weight_decay(config)
    return weight_decay if applied is None else applied


def _where_set(key: str, config: TrainingConfig) -> str:
    """Where the setting `key` (one of _SETTINGS) is set under `config`'s rule."""
    if key == "weight_decay" and rule_weight_decay(config) is not None:
        return f"the server's rule {config.rule} applies AdamW's decoupled decay: `gemps server --adam-weight-decay`"
    return _SETTINGS[key]


class ServerOwnedGroup(dict[str, Any]):
    """RemoteOptimizer's parameter group. Reading `lr` gives the server's η at the version the model
    holds, except to a torch scheduler being built; writing `lr` or `initial_lr`, a scheduler's
    reading them, and any reading of `initial_lr` raise ServerOwnsLearningRateError (instead of
    torch's KeyError, or a value the server would ignore). `momentum` and `weight_decay` read as
    they are applied (server_setting) and refuse a write with ValueError."""

    def __init__(
        self,
        group: dict[str, Any],
        config: Callable[[], TrainingConfig],
        learning_rate: Callable[[], float],
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(group)
        self.config = config  # the server's, whose schedule the error names
        self.learning_rate = learning_rate  # η at the version the model holds
        self.weight_decay = weight_decay  # the worker's (RemoteOptimizer's weight_decay=)

    def __missing__(self, key: str) -> Any:
        if key in LR_KEYS:
            scheduler = _scheduler_being_built()
            if key == "lr" and scheduler is None:
                return self.learning_rate()
            raise ServerOwnsLearningRateError(refusal(scheduler, self.config()))
        setting = server_setting(key, self.config(), self.weight_decay)
        if setting is None:
            raise KeyError(key)
        return setting

    def get(self, key: str, default: Any = None) -> Any:
        """As `group[key]` for `lr` and the server's settings (dict.get never asks __missing__, and
        None or the caller's default would hide what the server applies)."""
        if key not in self and (key == "lr" or key in _SETTINGS):
            return self[key]
        return super().get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self._refuse_write(key)
        super().__setitem__(key, value)

    def setdefault(self, key: str, default: Any = None) -> Any:
        """Refused as a write for `lr`, `initial_lr` and the server's settings (dict.setdefault never
        calls __setitem__)."""
        if key not in self:
            self._refuse_write(key)
        return super().setdefault(key, default)

    def _refuse_write(self, key: str) -> None:
        if key in LR_KEYS:
            raise ServerOwnsLearningRateError(refusal(_scheduler_being_built(), self.config()))
        if key in _SETTINGS:
            raise ValueError(
                f"the gemps server owns the update: RemoteOptimizer's group {key!r} reads what the server applies "
                f"({server_setting(key, self.config(), self.weight_decay):g}) and cannot be set here "
                f"({_where_set(key, self.config())})"
            )

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
            f"to read or set. {now} A training loop's own schedule (nanoGPT's get_lr: a linear warm-up, then a "
            "cosine decay to a minimum) is the server's:\n\n"
            f"    {' '.join(SCHEDULE_FLAGS)}\n\n"
            "where LR is the peak learning rate, W the warm-up and T the decay's length (warm-up included) in "
            "commits of all workers together, MIN the floor (a step decay instead: --lr-schedule step "
            "--lr-step-size S --lr-gamma G; `gemps server --help`). Remove the assignment; "
            "optimizer.learning_rate is η at the version the model holds."
        )
    name = type(scheduler).__name__
    flags, caveat = equivalent(scheduler)
    if _built_by_transformers(scheduler):
        same = (
            f"this one's is\n\n    gemps server --learning-rate LR {' '.join(flags)}\n\nwhere K is the commits all "
            "workers together make between two of the Trainer's optimizer steps (N for N workers committing once "
            f"a step each){caveat}"
            if flags is not None
            else f"gemps has none like this one{caveat}"
        )
        advice = (
            "Hugging Face's Trainer builds this schedule itself (TrainingArguments.lr_scheduler_type, 'linear' by "
            "default) when given optimizers=(optimizer, None): give it the server's schedule instead, "
            "Trainer(..., optimizers=(optimizer, gemps.pytorch.ServerSchedule(optimizer))), whose get_last_lr() "
            f"is the server's η, and set the server's with `gemps server`: {same}."
        )
    elif flags is None:
        advice = (
            f"Remove the scheduler: gemps has no schedule like {name}'s{caveat}. The server's are constant, "
            "step (exponential decay too: --lr-step-size 1), cosine, a linear decay after the warm-up, each with "
            "an optional linear warm-up (`gemps server --help`)."
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
    if _built_by_transformers(scheduler):
        return _transformers_equivalent(scheduler)
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
        if scheduler.end_factor != 1 and scheduler.start_factor == 1:
            return [
                f"--lr-schedule {schedules.WARMUP_LINEAR}",
                f"--lr-total-commits {_times_k(scheduler.total_iters)}",
                f"--lr-min <{scheduler.end_factor:g}*LR>",
            ], ""
        if scheduler.end_factor != 1:
            return None, f" (a linear ramp from {scheduler.start_factor:g}·lr to {scheduler.end_factor:g}·lr)"
        return [f"--lr-warmup-commits {_times_k(scheduler.total_iters)}"], (
            f"; the server's warm-up starts from LR/W rather than {scheduler.start_factor:g}·LR, and "
            "multiplies any --lr-schedule"
        )
    return None, ""


#: a warm-up then a cosine decay to a floor, as `gemps server` flags (the refusal of a write to `lr`):
#: nanoGPT's get_lr, the cosine counted from the warm-up's end
SCHEDULE_FLAGS = (
    "gemps server --learning-rate LR",
    "--lr-warmup-commits W",
    f"--lr-schedule {schedules.WARMUP_COSINE}",
    "--lr-total-commits T",
    "--lr-min MIN",
)


#: transformers' schedules (the lambdas of its get_scheduler) that the server's give, by function name
_TRANSFORMERS_SCHEDULES = {
    "_get_linear_schedule_with_warmup_lr_lambda": schedules.WARMUP_LINEAR,
    "_get_cosine_schedule_with_warmup_lr_lambda": schedules.WARMUP_COSINE,
    "_get_constant_schedule_with_warmup_lr_lambda": schedules.CONSTANT,
    "_get_constant_lambda": schedules.CONSTANT,
}


def _transformers_equivalent(scheduler: Any) -> tuple[list[str] | None, str]:
    """`equivalent` for a schedule transformers built: its lambda is a functools.partial whose
    keywords are the schedule's steps (transformers.optimization)."""
    function = scheduler.lr_lambdas[0]
    name = _TRANSFORMERS_SCHEDULES.get(getattr(getattr(function, "func", function), "__name__", ""))
    keywords = getattr(function, "keywords", None) or {}
    if name is None or keywords.get("num_cycles", 0.5) != 0.5:
        return None, ""
    flags = (
        [f"--lr-warmup-commits {_times_k(keywords['num_warmup_steps'])}"] if keywords.get("num_warmup_steps") else []
    )
    if name != schedules.CONSTANT:
        flags += [f"--lr-schedule {name}", f"--lr-total-commits {_times_k(keywords['num_training_steps'])}"]
        if keywords.get("min_lr_rate"):
            flags.append(f"--lr-min <{keywords['min_lr_rate']:g}*LR>")
    offset = "; the server's warm-up gives version v (v + 1)/W of LR where the Trainer's step v gets v/W"
    return flags or [f"--lr-schedule {schedules.CONSTANT}"], offset if keywords.get("num_warmup_steps") else ""


def _built_by_transformers(scheduler: object) -> bool:
    """Whether `scheduler` is a LambdaLR of Hugging Face's (transformers.optimization's lambdas,
    which its Trainer builds when given no scheduler)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return False
    lambdas = [getattr(function, "func", function) for function in scheduler.lr_lambdas]  # functools.partial
    return any(getattr(function, "__module__", "").startswith("transformers.") for function in lambdas)


class ServerSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The server's learning-rate schedule as a torch LR scheduler, for a framework that must hold
    one (Hugging Face's Trainer: `optimizers=(optimizer, ServerSchedule(optimizer))`): it sets
    nothing, `step()` only counts its calls, and `get_last_lr()` is the server's η at the version
    the model holds (RemoteOptimizer.learning_rate), which the framework logs. A LambdaLR with no
    lambdas, as the Trainer's signature asks for one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = getattr(optimizer, "param_groups", None)
        if not groups or not all(isinstance(group, ServerOwnedGroup) for group in groups):
            raise TypeError(
                "ServerSchedule reads the learning rate of a gemps RemoteOptimizer's server; "
                f"{type(optimizer).__name__} is not one (give it the RemoteOptimizer itself)"
            )
        # LRScheduler.__init__ is left out: it reads and sets the groups' lr, which the server owns.
        self.optimizer = optimizer
        self.lr_lambdas = []
        self.last_epoch = 0
        self._step_count = 1  # as torch's after the step its __init__ takes
        self.base_lrs = [float(lr) for lr in self.get_lr()]
        self._last_lr = self.get_lr()

    def get_lr(self) -> list[float | torch.Tensor]:
        """η at the version the model holds, per group (a RemoteOptimizer has one)."""
        groups = [group for group in self.optimizer.param_groups if isinstance(group, ServerOwnedGroup)]
        return [group.learning_rate() for group in groups]

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """As get_lr: the server's η now, not as it was at the last step() (the other workers'
        commits move the version between two)."""
        return self.get_lr()

    def step(self, epoch: int | None = None) -> None:
        """Counts the call (`last_epoch`); the server moves η with the central version. The first,
        from a Hugging Face Trainer, warns of its TrainingArguments that do not train
        (gemps.pytorch.trainer_arguments)."""
        if epoch is not None:
            raise TypeError("ServerSchedule.step() takes no epoch: the server's η follows the central version")
        if self._step_count == 1:
            group = next(g for g in self.optimizer.param_groups if isinstance(g, ServerOwnedGroup))
            warn_unused(group.config(), group.weight_decay)
        self.last_epoch += 1
        self._step_count += 1

    def state_dict(self) -> dict[str, Any]:
        """Only the count of step() calls: η is the server's."""
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["last_epoch"])


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
    """The `gemps server` flags of the schedule the server announced (gemps_proto.schedules)."""
    flags = [f"--learning-rate {config.learning_rate:g}", f"--lr-schedule {config.lr_schedule or schedules.CONSTANT}"]
    settings = schedules.schedule_settings(config)
    return flags + [f"--{name.replace('_', '-')} {schedules.setting_text(value)}" for name, value in settings.items()]


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
