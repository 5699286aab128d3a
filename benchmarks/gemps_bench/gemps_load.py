"""gemps under load: a real `gemps server` process and SDK clients, each a registered worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gemps.client import Client


class GempsCommitClient:
    """One registered worker committing through the SDK, as a user's worker would."""

    def __init__(self, target: str, index: int, num_parameters: int, client_options: dict[str, Any]) -> None:
        self._client = Client(target, name=f"bench-{index}", timeout=600, **client_options)
        self._client.register({"theta": np.zeros(num_parameters, dtype=np.float32)})

    def commit(self, gradient: np.ndarray) -> int | None:
        return self._client.commit(gradient).staleness

    def close(self) -> None:
        self._client.leave()
        self._client.close()


@dataclass(frozen=True)
class GempsClientFactory:
    target: str
    num_parameters: int
    client_options: tuple[tuple[str, Any], ...] = ()  # gemps.Client keyword arguments

    def __call__(self, index: int) -> GempsCommitClient:
        return GempsCommitClient(self.target, index, self.num_parameters, dict(self.client_options))
