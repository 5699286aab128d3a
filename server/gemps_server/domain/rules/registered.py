"""The workers registered, for a rule whose group of commits is as large as they are by default
(delayed-nesterov's cycle, adamw's round): a rule mixes it in beside CommitRule.

A checkpoint keeps no workers: they register again after a restore. So a rule keeps the group's
size its checkpoint recorded until as many have registered again (or one left: the job shrank),
else the first worker back would close a group at each of its commits, stepping alone at the rate
the job set for all of them."""

from __future__ import annotations

import numpy as np


class RegisteredWorkers:
    """Counts the registered workers through CommitRule's add_worker and remove_worker hooks, and
    holds the group's size a restore brought back (`kept_group`) until the job's workers are."""

    _registered: frozenset[str] = frozenset()  # replaced, never changed in place: no instance shares it
    _kept = 0  # the group's size restored from a checkpoint, until as many registered again (0: none)
    backup_workers = 0  # registered workers a group does not wait for (adamw's option of that name)

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:
        self._registered = self._registered | {worker_id}
        if self.registered() - self.backup_workers >= self._kept:  # the job's workers are back
            self._kept = 0

    def remove_worker(self, worker_id: str) -> None:
        self._registered = self._registered - {worker_id}
        self._kept = 0  # the job shrank: the group follows the workers again

    def registered(self) -> int:
        """How many workers are registered now."""
        return len(self._registered)

    def kept_group(self) -> int:
        """The group's size kept from before a restore (0: it follows the registrations)."""
        return self._kept

    def group_to_keep(self, workers: bool, size: int) -> int:
        """The kept size a state image carries: a backup's image (`workers`), which adopts the
        workers too, carries what this rule keeps; a checkpoint, which keeps none, the group's
        `size` now (0 where an option fixes it) for the workers that will register again."""
        return self._kept if workers else size

    def keep_group(self, size: int) -> None:
        """Restore the kept size a state image carried (group_to_keep)."""
        self._kept = size
