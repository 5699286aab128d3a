"""Adam's β1 raised over a run's first steps: the windows recipe's momentum (docs/guides/sdk.md).

Workers that commit windows of local AdamW steps in rounds (`gemps server --rule adamw
--outer-rate 1`) keep their AdamW moments while θ is replaced by the round's mean, so a longer β1
carries each worker's direction across the rounds. Measured on the character GPT (docs/RESULTS.md,
"Rounds of local steps"), β1 0.95 from the first step ends a long run lowest but is behind 0.9 for
its first third; rising from 0.9 to 0.95 over the first quarter of the steps is level with 0.9 in a
short run and within the windows' bar at the middle and the end of a long one. `Beta1Ramp` is that
schedule, stepped like a torch learning-rate scheduler: after each of the optimizer's steps.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

#: the windows recipe's ramp: β1 from the optimizer's (nanoGPT's 0.9) to RECIPE_TO over this share
#: of each worker's planned steps (`LocalSteps(..., planned_steps=N)` runs it: window_recipe.py)
RECIPE_SHARE = 0.25
RECIPE_TO = 0.95


class _Stepped(Protocol):
    param_groups: list[dict[str, Any]]


class Beta1Ramp:
    """Each parameter group's β1 from the one it has now to `to`, linearly over `steps` calls of
    `step()`, then held there; β2 and everything else as the group has them.

        inner = torch.optim.AdamW(model.parameters(), lr=4e-3, betas=(0.9, 0.99))
        optimizer = LocalSteps(model, inner, address, steps=8)
        ramp = Beta1Ramp(optimizer, to=0.95, steps=planned_steps // 4)
        ...
        optimizer.step(loss=loss.detach())
        ramp.step()

    `optimizer` is any optimizer whose groups carry `betas` (Adam, AdamW, LocalSteps over one)."""

    def __init__(self, optimizer: _Stepped, to: float, steps: int) -> None:
        if isinstance(to, bool) or not isinstance(to, int | float) or not (math.isfinite(to) and 0 <= to < 1):
            raise ValueError(f"Beta1Ramp: to={to!r}, where β1 lies in [0, 1)")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"Beta1Ramp: steps={steps!r}, where the ramp takes at least 1 step")
        groups = optimizer.param_groups
        missing = [index for index, group in enumerate(groups) if "betas" not in group]
        if missing:
            raise TypeError(
                f"Beta1Ramp: parameter group(s) {missing} have no betas (an Adam-family optimizer's); "
                f"{type(optimizer).__name__} was given"
            )
        self._groups = groups
        self.to, self.steps = float(to), steps
        self.starts = [float(group["betas"][0]) for group in groups]  # each group's β1 at step 0
        self.done = 0

    @property
    def beta1s(self) -> list[float]:
        """Each group's β1 after the steps taken so far."""
        share = min(1.0, self.done / self.steps)
        return [start + (self.to - start) * share for start in self.starts]

    def step(self) -> None:
        """One optimizer step taken: the next one's β1."""
        self.done += 1
        for group, beta1 in zip(self._groups, self.beta1s, strict=True):
            group["betas"] = (beta1, *tuple(group["betas"])[1:])

    def state_dict(self) -> dict[str, Any]:
        """The ramp's target, length, each group's starting β1 and the steps taken (for a checkpoint)."""
        return {"to": self.to, "steps": self.steps, "starts": list(self.starts), "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume a ramp saved by `state_dict()` (its groups' β1 are written at the next step)."""
        if len(state["starts"]) != len(self._groups):
            raise ValueError(
                f"Beta1Ramp: the saved ramp has {len(state['starts'])} parameter groups, "
                f"this optimizer {len(self._groups)}"
            )
        self.to, self.steps = float(state["to"]), int(state["steps"])
        self.starts, self.done = [float(start) for start in state["starts"]], int(state["done"])
