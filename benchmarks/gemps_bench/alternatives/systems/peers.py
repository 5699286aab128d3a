"""The peers' worker programs (alternatives/peers/<program>.py, CONTRACT.md) as systems: each entry of
peers/peers.json, run with its own interpreter, its coordinator first where it has one, its local
optimizer the entry's (`torchft_ddp_adamw` is program `torchft_ddp` with `--optimizer adamw`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gemps_bench.alternatives.contract import OPTIMIZERS, worker_argv
from gemps_bench.alternatives.systems.base import Launch, RunPlan, System

MANIFEST = Path(__file__).parents[1] / "peers" / "peers.json"
REPOSITORY = Path(__file__).parents[4]
COORDINATOR_PORT = 29500


@dataclass(frozen=True)
class PeerEntry:
    python: str = ""  # relative to the repository root; empty: the harness's interpreter
    coordinator: bool = False
    snapshot_rank: int = 0
    program: str = ""  # the module under alternatives/peers/; empty: the system's name
    optimizer: str = "sgd"  # the workers' --optimizer (contract.OPTIMIZERS)


def manifest(path: Path = MANIFEST) -> dict[str, PeerEntry]:
    """The peers the manifest lists ({} where there is none yet)."""
    if not path.exists():
        return {}
    try:
        entries = {name: PeerEntry(**entry) for name, entry in json.loads(path.read_text()).items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    for name, entry in entries.items():
        if entry.optimizer not in OPTIMIZERS:
            raise ValueError(f"{path}: {name}'s optimizer {entry.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    return entries


class Peer(System):
    def __init__(self, name: str, entry: PeerEntry) -> None:
        self.name = name
        self.entry = entry
        self.optimizer = entry.optimizer

    def unavailable(self) -> str | None:
        if self.entry.python and not (REPOSITORY / self.entry.python).exists():
            return f"{self.name} runs {self.entry.python}, which is not there: `make peers-venv` builds it"
        return None

    def python(self, plan: RunPlan) -> str:
        return str(REPOSITORY / self.entry.python) if self.entry.python else plan.python

    def coordinator(self, plan: RunPlan) -> Launch | None:
        if not self.entry.coordinator:
            return None
        return self._launch(plan, 0, "coordinator")

    def worker(self, plan: RunPlan, rank: int) -> Launch:
        return self._launch(plan, rank, "worker")

    def _launch(self, plan: RunPlan, rank: int, role: str) -> Launch:
        argv = worker_argv(
            f"gemps_bench.alternatives.peers.{self.entry.program or self.name}", plan.workload.name, rank,
            plan.workers, plan.seed, plan.workload.batch, plan.learning_rate, plan.run_dir, plan.deadline_s,
            plan.snapshot_every, self.optimizer,
        )  # fmt: skip
        argv += ["--role", role]
        if self.entry.coordinator:
            argv += ["--coordinator", f"{plan.coordinator_address}:{COORDINATOR_PORT}"]
        return Launch([self.python(plan), *argv], env={"OMP_NUM_THREADS": "1"})
