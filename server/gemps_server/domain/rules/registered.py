"""The workers registered, for a rule whose group of commits is as large as they are by default
(delayed-nesterov's cycle, adamw's round): a rule mixes it in beside CommitRule."""

from __future__ import annotations

import numpy as np


class RegisteredWorkers:
    """Counts the registered workers through CommitRule's add_worker and remove_worker hooks."""

    _registered: frozenset[str] = frozenset()  # replaced, never changed in place: no instance shares it

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:
        self._registered = self._registered | {worker_id}

    def remove_worker(self, worker_id: str) -> None:
        self._registered = self._registered - {worker_id}

    def registered(self) -> int:
        """How many workers are registered now."""
        return len(self._registered)
