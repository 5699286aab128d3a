"""The commit-rule interface: how a worker's update moves the central variable."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

# Parameters past this many get their median scaling estimated from an evenly strided sample:
# an exact median is a partial sort of P values on every commit, too slow for the hot path.
MEDIAN_SAMPLE_SIZE = 65_536


@dataclass(frozen=True)
class RuleParams:
    learning_rate: float = 0.05
    momentum: float = 0.9
    kappa: float = 1.0
    pi_max: float = 5.0


@dataclass(frozen=True)
class ApplyStats:
    """How one commit was scaled (GEM's pi per parameter; a constant for the other rules).

    The energies are GEM's two sides of its compliance condition, averaged over parameters
    (NaN for rules without a proxy): `proxy_energy` = mean kappa*|m_i|, the target a single
    momentum-SGD worker sets; `central_energy` = mean (|theta - s_i| + pi*|Delta|), the central
    variable's movement over worker i's round trip: what the other workers moved it since i's
    last commit plus what this commit adds. GEM picks pi so the two are equal wherever pi is not
    clamped; central above proxy means the others already spent more than the proxy's energy.
    """

    scaling_mean: float
    scaling_median: float
    fraction_at_zero: float
    fraction_at_max: float
    proxy_energy: float = math.nan
    central_energy: float = math.nan

    @classmethod
    def constant(cls, scale: float, scale_max: float = float("inf")) -> ApplyStats:
        return cls(scale, scale, float(scale == 0.0), float(scale >= scale_max))

    @classmethod
    def of(
        cls,
        scaling: np.ndarray,
        scale_max: float,
        proxy_energy: float = math.nan,
        central_energy: float = math.nan,
    ) -> ApplyStats:
        size = scaling.size
        if size == 0:
            return cls.constant(0.0)
        stride = max(1, size // MEDIAN_SAMPLE_SIZE)
        return cls(
            scaling_mean=float(scaling.mean(dtype=np.float64)),
            scaling_median=float(np.median(scaling[::stride])),
            fraction_at_zero=np.count_nonzero(scaling <= 0.0) / size,
            fraction_at_max=np.count_nonzero(scaling >= scale_max) / size,
            proxy_energy=proxy_energy,
            central_energy=central_energy,
        )


class CommitRule(ABC):
    """Applies worker updates to the central variable, one at a time, in FIFO order.

    The applier calls every method from one thread, never concurrently. `apply` moves `theta`
    in place; `update` is the commit's Delta (already -eta*g for gradients) and is scratch space
    the rule may overwrite.
    """

    name: ClassVar[str]
    #: float32 vectors of P parameters kept per registered worker (for memory accounting).
    vectors_per_worker: ClassVar[int] = 0

    def __init__(self, params: RuleParams, num_parameters: int) -> None:
        self.params = params
        self.num_parameters = num_parameters

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:  # noqa: B027 (optional hook)
        """A worker registered while the central variable is `theta`."""

    def remove_worker(self, worker_id: str) -> None:  # noqa: B027 (optional hook)
        """A worker left or was evicted: free its state."""

    def global_state(self) -> dict[str, np.ndarray]:
        """Copies of the rule's state shared by all workers (for checkpoints); none by default."""
        return {}

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `global_state` returned (from a checkpoint); raises ValueError if it does not fit."""
        if state:
            raise ValueError(f"rule {self.name!r} keeps no global state, got {sorted(state)}")

    @abstractmethod
    def apply(self, theta: np.ndarray, update: np.ndarray, worker_id: str, staleness: int) -> ApplyStats:
        """Move theta in place by this worker's update, computed `staleness` commits ago."""
