"""The `gemps worker` options of how local steps learn, which only some modes read: which modes,
what the option is, and the refusal of one given to a mode that does not read it, which took it
silently (issue 77: `--mode gradient --outer-learning-rate 0.5` trained as though it were not there).

The help of each option is worded from the same table (`read_by`), so it lists every mode that
reads the option and no other.
"""

from __future__ import annotations

from collections.abc import Mapping

from gemps_worker.modes import WorkerMode

AGN, DYNSGD, DYLU, EASGD = WorkerMode.AGN, WorkerMode.DYNSGD, WorkerMode.DYLU, WorkerMode.EASGD
LOCAL_STEPS = (AGN, DYNSGD, DYLU, EASGD)  # the modes that train locally between commits
WINDOWS = (AGN, DYNSGD, DYLU)  # the modes that commit a window's accumulated update

#: each option of how local steps learn, read by some modes only: what it is, and those modes. The
#: modes' own window sizes (--agn-steps, --easgd-period, ...) are not here: each one's help names
#: its mode, and harnesses give one set of them to every mode they run.
READ_ONLY_BY: dict[str, tuple[str, tuple[WorkerMode, ...]]] = {
    "local_optimizer": ("the optimizer of local steps", LOCAL_STEPS),
    "local_learning_rate": ("the learning rate of local steps", LOCAL_STEPS),
    "outer_learning_rate": ("the factor of a window's accumulated update", WINDOWS),
}

#: what each mode commits, for the refusal of an option it does not read
COMMITS = {
    WorkerMode.GRADIENT: "commits each mini-batch's gradient and takes no local steps",
    AGN: "commits the mean update of its window of agn_steps",
    DYNSGD: "commits the update of its window of dynsgd_steps",
    DYLU: "commits the update of its window of up to dylu_steps",
    EASGD: "commits alpha(x - θ) every easgd_period local steps, no window's update",
}


def read_by(option: str) -> str:
    """The modes that read `option`, as its help begins: "agn, dynsgd, dylu, easgd"."""
    return ", ".join(mode.value for mode in READ_ONLY_BY[option][1])


def unread_options(mode: str, values: Mapping[str, object], defaults: Mapping[str, object]) -> list[str]:
    """One line per option of `values` other than its default that `mode` does not read."""
    found = []
    for option, (what, modes) in READ_ONLY_BY.items():
        value = values[option]
        if value == defaults[option] or mode in modes or mode not in COMMITS:
            continue  # an unknown mode: create_mode refuses it
        found.append(
            f"{option} {value!r}: {what}, read by modes {read_by(option)} only; "
            f"mode {mode} {COMMITS[WorkerMode(mode)]}: drop it, or choose one of those modes"
        )
    return found
