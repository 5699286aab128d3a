"""gemps in its shipped settings: a `gemps server` in the coordinator's slot, a gemps_program worker
per rank, and an observer beside the server that pulls θ for the snapshots.

- gemps-gem: GEM on gradients, every default as shipped (float32 both ways);
- gemps-gem-int8: the same, commits and replies in int8 codes (error feedback; difference replies);
- gemps-gem-local: GEM with 8 local Adam steps a commit, the update times 0.35, int8 both ways (the
  recommended setting of docs/RESULTS.md "Local steps that hold accuracy", `--mode dynsgd
  --dynsgd-steps 8 --local-optimizer adam --local-learning-rate 0.003 --outer-learning-rate 0.35`);
  the searched rate sets the Adam rate, 0.06 eta (0.003 at eta 0.05: the same doubling grid around
  the setting as every system's), since GEM takes an update commit as sent;
- gemps-dn-dylu: asynchronous Local-SGD with delayed Nesterov on the server (`--rule
  delayed-nesterov`, its defaults: epsilon 0.7, beta 0.9, N the workers registered) and dynamic local
  updates on the workers (`--mode dylu`, H = 8 for the fastest), float32 both ways: the setting of
  docs/RESULTS.md "Delayed Nesterov and dynamic local updates";
- gemps-adam: the SDK's recipe for asynchronous AdamW workers (docs/guides/sdk.md, "LocalSteps"):
  each worker steps nanoGPT's AdamW at the searched rate (ADAMW_LEARNING_RATES) inside `LocalSteps`
  at its defaults (steps=1, look_ahead=1), the server `--rule downpour` (each update applied as
  sent), float32 both ways;
- gemps-adamw: AdamW on the server, a round of gradients a step with one backup worker (`--rule adamw
  --backup-workers 1`, nanoGPT's betas 0.9/0.99 and decay 0.1, at the searched rate): the workers
  commit gradients and wait for each round (docs/guides/sdk.md, "Many AdamW workers"); a round
  closes at the first N - 1 gradients, so none waits for the slowest;
- gemps-adamw-all: gemps-adamw with every round waiting for all N gradients (`--backup-workers 0`):
  DDP's computation, to tell what the backup worker costs or saves;
- gemps-adamw-int8: the same, commits and replies in int8 codes (gemps-gem-int8's), for slow links;
- gemps-adamw-windows: the SDK's AdamW recipe for slow links (docs/guides/sdk.md, "Many AdamW
  workers", its rounds of local windows): each worker's nanoGPT AdamW at the searched rate inside
  `LocalSteps(steps=8)`, int8 codes both ways, the server `--rule adamw --outer-rate 1
  --backup-workers 1` (each round's first N - 1 windows averaged): 8x fewer commits than a step a
  commit, each a quarter of float32's bytes. nanoGPT's β1 0.9: the guide's for short runs, which
  a cell of a few minutes is;
- gemps-adamw-windows-long: the same at β1 0.95, the guide's for runs of nanoGPT's length and
  longer (behind 0.9 in their first third, ahead after it).

Each worker runs under its supervisor (`--supervise`, gemps_worker.supervisor, as `gemps worker
--supervise on`): a worker kill kills the worker it forked and spares the supervisor, which forks
a new one at once, its imports and data already in memory (until 2026-11-29 the rig killed the
whole slot and started it again 5 s later, torch imported anew: 16-22 s a kill on a slow host).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from gemps.options import to_argv
from gemps_bench.alternatives.contract import worker_argv
from gemps_bench.alternatives.systems.base import COORDINATOR, Launch, RunPlan, System

PORT = 50051  # the server's port in the coordinator's own namespace (nothing else binds there)
PROGRAM = "gemps_bench.alternatives.systems.gemps_program"


@dataclass(frozen=True)
class Setting:
    """One shipped setting: the server's rule and the worker's mode and codes."""

    rule: str = "gem"
    mode: str = "gradient"
    local_steps: int = 4  # dynsgd's and dylu's; mode local-steps' `steps` (the SDK recipe's 1, or a window)
    outer_learning_rate: float = 0.0
    compression: str = "none"
    local_optimizer: str = "sgd"
    local_rate_per_eta: float = 0.0  # the local steps' rate over the searched eta (0: sgd at eta)
    optimizer: str = "sgd"  # what steps at the searched rate: mode local-steps' inner optimizer, or the server's
    server: tuple[tuple[str, object], ...] = ()  # the server's options besides its rule
    beta1: float | None = None  # mode local-steps' AdamW β1 (None: nanoGPT's 0.9)


#: gemps-adamw's server: nanoGPT's betas and decay, a round closing at the first N - 1 gradients
ADAMW_SERVER: tuple[tuple[str, object], ...] = (("adam_beta2", 0.99), ("adam_weight_decay", 0.1), ("backup_workers", 1))

#: the windows' AdamW β1 for long runs: a longer memory than nanoGPT's 0.9 across the rounds (docs/RESULTS.md,
#: "Rounds of local steps")
LONG_RUN_BETA1 = 0.95

SETTINGS: dict[str, Setting] = {
    "gemps-gem": Setting(),
    "gemps-gem-int8": Setting(compression="int8"),
    "gemps-gem-local": Setting(
        mode="dynsgd",
        local_steps=8,
        outer_learning_rate=0.35,
        compression="int8",
        local_optimizer="adam",
        local_rate_per_eta=0.06,
    ),
    "gemps-dn-dylu": Setting(rule="delayed-nesterov", mode="dylu", local_steps=8),
    "gemps-adam": Setting(rule="downpour", mode="local-steps", local_steps=1, optimizer="adamw"),
    "gemps-adamw": Setting(rule="adamw", optimizer="adamw", server=ADAMW_SERVER),
    "gemps-adamw-all": Setting(rule="adamw", optimizer="adamw", server=(*ADAMW_SERVER[:2], ("backup_workers", 0))),
    "gemps-adamw-int8": Setting(rule="adamw", optimizer="adamw", server=ADAMW_SERVER, compression="int8"),
    "gemps-adamw-windows": Setting(
        rule="adamw",
        mode="local-steps",
        local_steps=8,
        optimizer="adamw",
        compression="int8",
        server=(("outer_rate", 1.0), ("backup_workers", 1)),  # AdamW's own options belong to the workers here
    ),
}
SETTINGS["gemps-adamw-windows-long"] = replace(SETTINGS["gemps-adamw-windows"], beta1=LONG_RUN_BETA1)


class Gemps(System):
    def __init__(self, name: str) -> None:
        self.name = name
        self.setting = SETTINGS[name]
        self.optimizer = self.setting.optimizer
        self.replicated = False  # set by coordinator(): the plan says

    def coordinator(self, plan: RunPlan) -> Launch:
        self.replicated = plan.replicas > 1
        options = {
            "host": plan.coordinator_address,
            "port": PORT,
            "rule": self.setting.rule,
            "learning_rate": plan.learning_rate,
            "batch_size": plan.workload.batch,
            "metrics_port": -1,
            # checkpoints as shipped (every 60 s): in scenario e the killed primary's state is its
            # backup's, which takes over and brings the restarted replica up to date; a checkpoint
            # every 5 s (until 2026-12-03) cost each replica 0.1-0.2 s of the coordinator's 0.3 core
            "checkpoint_dir": plan.run_dir / "checkpoints",
            # scenario e: a primary and a backup, each its own process (the supervisor starts a
            # private etcd and restarts a replica that dies), in the coordinator's slot
            "replicas": plan.replicas,
            **dict(self.setting.server),
        }
        return Launch([plan.python, "-m", "gemps_cli", "server", *to_argv(options)])

    def observer(self, plan: RunPlan) -> Launch:
        return self._program(plan, 0, role="coordinator")

    def worker(self, plan: RunPlan, rank: int) -> Launch:
        setting = self.setting
        extra = ["--supervise", "--mode", setting.mode, "--local-steps", str(setting.local_steps)]
        extra += ["--outer-learning-rate", repr(setting.outer_learning_rate), "--compression", setting.compression]
        rate = setting.local_rate_per_eta * plan.learning_rate
        extra += ["--local-optimizer", setting.local_optimizer, "--local-learning-rate", repr(rate)]
        if setting.mode == "local-steps":
            extra += ["--optimizer", setting.optimizer]
        if setting.beta1 is not None:
            extra += ["--beta1", repr(setting.beta1)]
        return Launch([*self._program(plan, rank).argv, *extra])

    def _program(self, plan: RunPlan, rank: int, role: str = "worker") -> Launch:
        argv = worker_argv(
            PROGRAM, plan.workload.name, rank, plan.workers, plan.seed, plan.workload.batch,
            plan.learning_rate, plan.run_dir, plan.deadline_s, plan.snapshot_every,
        )  # fmt: skip
        servers = "|".join(f"{plan.coordinator_address}:{PORT + r}" for r in range(plan.replicas))
        return Launch([plan.python, *argv, "--coordinator", servers, "--role", role])

    def killed(self, target: int, pids: list[int], launched_pid: int) -> list[int]:
        """A worker kill kills the worker, not its supervisor (the process the rig launched),
        which forks a new one. With replicas, a coordinator kill kills the primary's process alone
        (its title says `primary`): the server's supervisor starts it again, and the backup takes
        over meanwhile."""
        if target != COORDINATOR:
            return [pid for pid in pids if pid != launched_pid]
        primary = [pid for pid in pids if b"primary" in _command_line(pid)]
        return primary or pids

    def restarts_itself(self, target: int) -> bool:
        return target != COORDINATOR or self.replicated


def _command_line(pid: int) -> bytes:
    """What `ps` shows of a process (a gemps server's title), empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
