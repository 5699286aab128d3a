"""What a system of the comparison tells the rig: how to start its coordinator and its workers, and
what killing and restarting one of them means for it.

The rig (rig.py) runs each command line inside a slot: worker i's CPU group and network namespace,
or the coordinator's (slot COORDINATOR). A system only builds command lines; the rig starts,
pauses, kills and restarts them, so every system gets the same faults without cooperating.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from gemps_bench.alternatives.contract import SNAPSHOT_EVERY
from gemps_bench.alternatives.workloads import Workload

COORDINATOR = -1  # the slot of a system's coordinator (server, rendezvous, lighthouse)

#: The learning-rate grid of every Adam-path system (its workers step nanoGPT's AdamW at the searched
#: rate, or its server does: gemps-adam, gemps-adamw, ddp-adamw, ddp-adamw-bf16, torchft_ddp_adamw,
#: hivemind_adamw), one grid for all of them so each gets the same search. Its centre is the recipe's
#: 1e-3 (gemps_worker.nanogpt's LEARNING_RATE); docs/RESULTS.md "Many workers" found DDP-AdamW best at
#: 3e-3 at a global batch of 16 x N for N = 4, 16 and 64 (1e-3: 1.764 against 1.569 at N = 4; 6e-3
#: worse than 3e-3 at 16), so the grid doubles from 5e-4 to 4e-3: both sides of 1e-3, and 2e-3 and
#: 4e-3 about the 3e-3 found best.
ADAMW_LEARNING_RATES = (5e-4, 1e-3, 2e-3, 4e-3)


@dataclass(frozen=True)
class Launch:
    """One process of a run: its command line and extra environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunPlan:
    """What a system needs to build its command lines for one run."""

    workload: Workload
    workers: int
    seed: int
    learning_rate: float
    run_dir: Path
    deadline_s: float  # each worker trains this long after the run starts, then exits
    coordinator_address: str  # the coordinator slot's address (its namespace's, or loopback)
    worker_addresses: tuple[str, ...]  # worker i's slot's address
    replicas: int = 1  # the coordinator's replicas, where the system has them (gemps in scenario e)
    snapshot_every: float = SNAPSHOT_EVERY  # seconds between two snapshots of the run
    python: str = sys.executable


class System(ABC):
    """A system under test: its name and how its processes start."""

    name: str
    #: the slot a coordinator kill kills: the coordinator's own, or a worker's that hosts it (DDP's rank 0)
    coordinator_slot: int = COORDINATOR
    #: the workers' local optimizer (the contract's `--optimizer`): "sgd", or "adamw" on the Adam path
    optimizer: str = "sgd"

    def learning_rates(self, workload: Workload) -> tuple[float, ...]:
        """The rates the search tries for this system: the workload's grid (SGD rates, gemps' η
        0.05 x {1/2, 1, 2}), or ADAMW_LEARNING_RATES for a system whose workers step AdamW at it."""
        return ADAMW_LEARNING_RATES if self.optimizer == "adamw" else workload.learning_rates

    def unavailable(self) -> str | None:
        """Why this system cannot run on this machine (what is missing, and how to get it), or None."""
        return None

    def coordinator(self, plan: RunPlan) -> Launch | None:
        """The coordinator's process (started first, and started again after a coordinator kill), or none."""
        return None

    def observer(self, plan: RunPlan) -> Launch | None:
        """A process that writes the snapshots beside the workers, outside every quota (gemps: one
        that pulls θ), or none when a worker writes them."""
        return None

    @abstractmethod
    def worker(self, plan: RunPlan, rank: int) -> Launch:
        """Worker `rank`'s process (started again with the same command after a kill)."""

    def killed(self, target: int, pids: list[int], launched_pid: int) -> list[int]:
        """Which of a slot's processes a kill of `target` (a worker's index, or COORDINATOR) kills;
        `launched_pid` is the process the rig started there. Default: all of them. DDP spares a
        worker's elastic agent, which restarts the group itself; gemps with replicas kills the
        primary alone, which its supervisor starts again as a backup."""
        return pids

    def restarts_itself(self, target: int) -> bool:
        """Whether the system brings a killed `target` back by itself (the rig then starts nothing)."""
        return False
