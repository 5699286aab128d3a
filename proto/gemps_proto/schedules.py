"""Learning-rate schedules: the server's eta as a function of the central version.

The server owns eta. A gradient g committed to the server is applied as -eta(v)*g, where v is
the central version the commit is applied at: the number of commits applied before it (the
first commit is applied at v = 0; Status reports eta at the current version, the one the next
commit gets). With eta0 = learning_rate, W = lr_warmup_commits, S = lr_step_size,
gamma = lr_gamma, T = lr_total_commits and eta_min = lr_min:

    eta(v)    = eta0 * warmup(v) * decay(v)
    warmup(v) = min(1, (v + 1) / W)     when W > 0, else 1
    decay(v)  = 1                                                            constant
              = gamma ** floor(v / S)                                        step
              = (eta_min + (eta0 - eta_min) * (1 + cos(pi * min(v, T) / T)) / 2) / eta0   cosine
              = 1 for v < W, then cosine's with v - W over T - W versions              warmup-cosine
              = 1 for v < W, then (eta_min + (eta0 - eta_min) * (T - min(v, T)) / (T - W)) / eta0
                                                                                       warmup-linear

Each factor is torch.optim.lr_scheduler's closed form with the version as its step count:
warmup is LinearLR(start_factor=1/W, total_iters=W-1) (the first commit gets eta0/W, commit W
and later ones the full factor), step is StepLR(step_size=S, gamma=gamma), cosine is
CosineAnnealingLR(T_max=T, eta_min=eta_min), held at eta_min after T versions where torch's
would rise again. Warm-up and decay multiply (LambdaLR with their product as lr_lambda): both
count from version 0, so T includes the warm-up. `warmup-cosine` counts the cosine from the
warm-up's end instead, as nanoGPT's get_lr and Hugging Face's get_cosine_schedule_with_warmup do
(T > W): a schedule ported from them keeps its shape (under `cosine` the same W and T give 4 % less
of the rate over a run of 200 steps with a warm-up of 10, 7.5 % less at its middle). `warmup-linear`
is Hugging Face's get_linear_schedule_with_warmup (its Trainer's default, lr_scheduler_type
"linear"): from the warm-up's end the rate falls in a straight line to eta_min (HF's: 0) at T, and
stays there. From version W on both give the same factor; in the warm-up HF's is v/W (0 at the
first step), the server's (v + 1)/W.

Workers that take local SGD steps (agn, easgd) use the same eta at the version they last loaded.
"""

from __future__ import annotations

import math
from typing import Protocol

CONSTANT = "constant"
STEP = "step"
COSINE = "cosine"
WARMUP_COSINE = "warmup-cosine"
WARMUP_LINEAR = "warmup-linear"
#: the schedules by name (TrainingConfig.lr_schedule)
SCHEDULES = (CONSTANT, STEP, COSINE, WARMUP_COSINE, WARMUP_LINEAR)
#: the schedules whose decay starts at the warm-up's end (lr_total_commits must be above it)
AFTER_WARMUP = (WARMUP_COSINE, WARMUP_LINEAR)


class ScheduleConfig(Protocol):
    """The fields of a training configuration that set its schedule. gemps_proto.schema's
    TrainingConfig has them (structurally): naming them here, not that class, keeps schema (which
    takes its choices from this module) and this module from importing each other."""

    @property
    def learning_rate(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def lr_warmup_commits(self) -> int: ...
    @property
    def lr_step_size(self) -> int: ...
    @property
    def lr_gamma(self) -> float: ...
    @property
    def lr_total_commits(self) -> int: ...
    @property
    def lr_min(self) -> float: ...


def _no_warmup(config: ScheduleConfig) -> bool:
    return config.lr_warmup_commits <= 0


def _no_decay(config: ScheduleConfig) -> bool:
    """An empty name (the protocol's default: a server that announces no schedule) is the constant schedule."""
    return config.lr_schedule in (CONSTANT, "")


def is_constant(config: ScheduleConfig) -> bool:
    """η is learning_rate at every version: the constant schedule, no warm-up."""
    return _no_warmup(config) and _no_decay(config)


def warmup_factor(config: ScheduleConfig, version: int) -> float:
    """min(1, (v + 1) / W): linear warm-up over lr_warmup_commits versions (1 when there is none)."""
    if _no_warmup(config):
        return 1.0
    return min(1.0, (version + 1) / config.lr_warmup_commits)


def decay_factor(config: ScheduleConfig, version: int) -> float:
    """The schedule's decay at `version`, relative to learning_rate (1 for the constant schedule)."""
    name = config.lr_schedule
    if _no_decay(config):
        return 1.0
    if name == STEP:
        return float(config.lr_gamma ** (version // config.lr_step_size))
    if name in (COSINE, WARMUP_COSINE, WARMUP_LINEAR):
        start = config.lr_warmup_commits if name in AFTER_WARMUP else 0  # the decay's version 0
        span = config.lr_total_commits - start
        done = min(max(version - start, 0), span) / span  # of the decay, from 0 to 1 (held there)
        left = 1 - done if name == WARMUP_LINEAR else (1 + math.cos(math.pi * done)) / 2
        return (config.lr_min + (config.learning_rate - config.lr_min) * left) / config.learning_rate
    raise ValueError(f"unknown lr_schedule {name!r} (choose from {', '.join(SCHEDULES)})")


def schedule_factor(config: ScheduleConfig, version: int) -> float:
    """η(v) / learning_rate: warm-up times decay."""
    return warmup_factor(config, version) * decay_factor(config, version)


def learning_rate_at(config: ScheduleConfig, version: int) -> float:
    """η at central version `version`: what a gradient committed at that version is scaled by."""
    return config.learning_rate * schedule_factor(config, version)


#: the fields each schedule reads besides learning_rate (any schedule's warm-up: lr_warmup_commits)
SCHEDULE_FIELDS = {
    CONSTANT: (),
    STEP: ("lr_step_size", "lr_gamma"),
    COSINE: ("lr_total_commits", "lr_min"),
    WARMUP_COSINE: ("lr_total_commits", "lr_min"),
    WARMUP_LINEAR: ("lr_total_commits", "lr_min"),
}
#: every field a schedule may read besides learning_rate
ALL_FIELDS = frozenset({"lr_warmup_commits", *(name for names in SCHEDULE_FIELDS.values() for name in names)})


def schedule_settings(config: ScheduleConfig) -> dict[str, float]:
    """The settings the schedule `config` runs reads, by field name: its own (none for constant),
    then lr_warmup_commits when there is a warm-up. The others (lr_gamma under cosine) do nothing,
    so `gemps status` and the SDK's refusals leave them out."""
    names = SCHEDULE_FIELDS.get(config.lr_schedule or CONSTANT, ())
    settings: dict[str, float] = {name: getattr(config, name) for name in names}
    if config.lr_warmup_commits > 0:
        settings["lr_warmup_commits"] = config.lr_warmup_commits
    return settings


def setting_text(value: float) -> str:
    """A setting as a flag takes it: a count in full (1000000, not 1e+06), a factor in %g."""
    return str(value) if isinstance(value, int) else f"{value:g}"
