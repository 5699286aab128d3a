"""LocalSteps' defaults: the SDK guide's recipe for the server it registered with.

One `LocalSteps(model, optimizer, address)` serves two recipes (docs/guides/sdk.md), and the server's
rule says which: asynchronous AdamW workers (`--rule downpour`), a commit every local step, each
window started where θ is headed; or rounds of windows (`--rule adamw --outer-rate r`), 8 local
steps a commit from each round's θ, the round's move as each worker's momentum
(gemps.pytorch.round_momentum) and β1 raised to 0.95 over the first quarter of the run
(gemps.pytorch.beta1_ramp). What a user leaves out is the recipe's; what a user gives is used as
given, or refused, naming why, where it cannot apply.
"""

from __future__ import annotations

import torch

from gemps.pytorch.beta1_ramp import RECIPE_SHARE, RECIPE_TO, Beta1Ramp
from gemps.pytorch.round_momentum import problem
from gemps.records import TrainingConfig
from gemps_proto.rule_options import OUTER_RATE

#: asynchronous AdamW workers: a commit every local step (docs/RESULTS.md, "Adam through asynchrony")
EVERY_STEP = 1
#: rounds of windows: 8 local steps a commit, 8x fewer commits at equal samples (docs/RESULTS.md,
#: "Rounds of local steps")
WINDOW_STEPS = 8


def takes_windows(config: TrainingConfig) -> bool:
    """Whether the server takes rounds of windows (`--rule adamw --outer-rate r`, r > 0)."""
    return config.rule_options.get(OUTER_RATE, 0) > 0


def check_steps(steps: int | None) -> None:
    """ValueError unless `steps` is None (the recipe's) or a whole number of local steps >= 1."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a whole number of local steps >= 1 (or None: the recipe's), not {steps!r}")


def window_steps(steps: int | None, config: TrainingConfig) -> int:
    """The local steps a window takes: `steps` as given, else the recipe's for the server's rule."""
    check_steps(steps)
    if steps is None:
        return WINDOW_STEPS if takes_windows(config) else EVERY_STEP
    return steps


def round_momentum_wanted(wanted: bool | None, optimizer: torch.optim.Optimizer, config: TrainingConfig) -> bool:
    """`round_momentum` as asked (None: wherever it applies); ValueError naming why when it is True
    and cannot apply."""
    if wanted is not None and not isinstance(wanted, bool):
        raise TypeError(f"round_momentum must be True, False or None (wherever it applies), not {wanted!r}")
    if wanted is False:
        return False
    if takes_windows(config):
        why = problem(optimizer)
    else:
        why = f"the server's rule {config.rule} takes no rounds of windows (--outer-rate)"
    if why is not None and wanted:
        raise ValueError(f"round_momentum=True: {why}")
    return why is None


def recipe_ramp(
    planned_steps: int | None, optimizer: torch.optim.Optimizer, config: TrainingConfig
) -> Beta1Ramp | None:
    """The recipe's β1 ramp over `planned_steps` (this worker's planned optimizer steps): from the
    optimizer's β1 to RECIPE_TO over their first RECIPE_SHARE, under rounds of windows. None when
    no steps are planned. A ramp asked for where the server takes no windows is refused (ValueError),
    as is an optimizer without betas (TypeError, Beta1Ramp's)."""
    if planned_steps is None:
        return None
    if isinstance(planned_steps, bool) or not isinstance(planned_steps, int) or planned_steps < 1:
        raise ValueError(f"planned_steps must be this worker's planned optimizer steps (>= 1), not {planned_steps!r}")
    if not takes_windows(config):
        raise ValueError(
            f"planned_steps={planned_steps}: it ramps β1 for rounds of windows (--rule adamw --outer-rate), "
            f"and the server's rule {config.rule} takes none"
        )
    return Beta1Ramp(optimizer, to=RECIPE_TO, steps=max(1, int(planned_steps * RECIPE_SHARE)))
