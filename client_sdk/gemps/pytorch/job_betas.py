"""Adam's betas over the job's samples, not one worker's: what `LocalSteps(job_betas=True)` does.

A worker's Adam averages its moments over about 1/(1 - β) of its own steps. With N workers
committing in turn, the job takes N steps for each of this worker's, so the same betas average
over N times as many of the job's samples as they do for one worker alone - more momentum than
the user asked for, on top of what asynchrony adds by itself (Mitliagkas et al. 2016, "Asynchrony
begets momentum"). `JobBetas` raises each group's β1 to the power of the commits the job applies
per commit of this worker (the staleness its commits meet, plus its own), so its momentum spans
the job's samples that the user's β1 spans for one worker alone: before every inner step, from
the β1 the user, or a scheduler after the step before, set last. β2, a horizon of hundreds of
steps that only scales Adam's steps, is left as the user set it (docs/RESULTS.md has both tried).
"""

from __future__ import annotations

from typing import Any

#: weight of the newest staleness in its running mean (commits meet 2-5 others' with 4 workers)
SMOOTHING = 0.25


class JobBetas:
    """Keeps each group's β1 at the user's to the power of the job's steps per this worker's."""

    def __init__(self, enabled: bool, groups: list[dict[str, Any]]) -> None:
        self.enabled = enabled
        self.per_own_commit = 1.0  # the job's commits per commit of this worker: 1 until one is seen
        self.rebind(groups)

    def rebind(self, groups: list[dict[str, Any]]) -> None:
        """Follow `groups` (after a load_state_dict), whose betas are the user's."""
        self._groups = groups
        self._users: list[tuple[float, ...] | None] = [
            None if group.get("betas") is None else tuple(group["betas"]) for group in groups
        ]
        self._set = list(self._users)

    def after_commit(self, staleness: int) -> None:
        """A commit met `staleness` others': the next window's β1s for the job's pace so far."""
        if not self.enabled:
            return
        self.per_own_commit += SMOOTHING * (staleness + 1 - self.per_own_commit)
        self.before_step()

    def before_step(self) -> None:
        """Before each inner step: each group's β1 as the user last set it, to the power of the
        job's pace. A scheduler that writes betas (OneCycleLR's and CyclicLR's cycle_momentum)
        does so after every step: raised only after a commit, its β1 was written over before
        AdamW stepped with it, and job_betas did nothing (issue 77)."""
        if not self.enabled:
            return
        self._adopt_users()
        for index, group in enumerate(self._groups):
            users = self._users[index]
            if users is None:  # an optimizer without betas (SGD): nothing to keep
                continue
            beta1, *rest = users
            self._set[index] = group["betas"] = (beta1**self.per_own_commit, *rest)

    def users(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict with each group's betas the user's (what a checkpoint keeps)."""
        if not self.enabled:
            return state  # the betas in use are the user's
        self._adopt_users()
        for saved, users in zip(state["param_groups"], self._users, strict=True):
            if users is not None:
                saved["betas"] = users
        return state

    def _adopt_users(self) -> None:
        """Betas other than those set here were set since, by the user or a scheduler: the user's."""
        for index, group in enumerate(self._groups):
            betas = group.get("betas")
            if betas is not None and (self._users[index] is None or tuple(betas) != self._set[index]):
                self._users[index] = tuple(betas)
