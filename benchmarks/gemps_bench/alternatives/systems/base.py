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
