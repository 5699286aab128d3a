"""PyTorch DDP under torchrun: one elastic agent per worker slot (`--nnodes W --nproc-per-node 1`),
c10d rendezvous hosted by slot 0's agent, `--max-restarts` so a failed worker restarts the group
(torchrun's own restart story), gloo between the workers. Three systems: `ddp` (SGD with momentum
0.9), `ddp-adamw` (nanoGPT's AdamW) and `ddp-adamw-bf16` (the same, its gradients all-reduced in
bfloat16 by torch's `bf16_compress_hook`): `VARIANTS`.

A kill of worker i kills its training process and spares its agent, which notices and restarts
the group (every agent re-rendezvouses); a coordinator kill kills slot 0 whole, agent and the
rendezvous store with it (DDP has no other coordinator), and the rig starts that agent again.
"""

from __future__ import annotations

from gemps_bench.alternatives.contract import worker_argv
from gemps_bench.alternatives.systems.base import COORDINATOR, Launch, RunPlan, System

RENDEZVOUS_PORT = 29400
MAX_RESTARTS = 100  # more than any scenario's kills
PROGRAM = "gemps_bench.alternatives.systems.ddp_program"
#: each DDP system's local optimizer and communication hook (ddp_program's --optimizer, --comm-hook)
VARIANTS: dict[str, tuple[str, str]] = {
    "ddp": ("sgd", "none"),
    "ddp-adamw": ("adamw", "none"),
    "ddp-adamw-bf16": ("adamw", "bf16"),
}


class Ddp(System):
    coordinator_slot = 0

    def __init__(self, name: str = "ddp") -> None:
        self.name = name
        self.optimizer, self.comm_hook = VARIANTS[name]

    def worker(self, plan: RunPlan, rank: int) -> Launch:
        address = plan.worker_addresses[rank]
        torchrun = [
            plan.python, "-m", "torch.distributed.run", "--nnodes", str(plan.workers), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{plan.worker_addresses[0]}:{RENDEZVOUS_PORT}",
            "--rdzv-id", f"alt-{plan.run_dir.name}", "--max-restarts", str(MAX_RESTARTS),
            "--local-addr", address, "--monitor-interval", "1",
        ]  # fmt: skip
        if rank == 0:
            torchrun += ["--rdzv-conf", "is_host=true"]
        program = worker_argv(
            PROGRAM, plan.workload.name, rank, plan.workers, plan.seed, plan.workload.batch,
            plan.learning_rate, plan.run_dir, plan.deadline_s, plan.snapshot_every, self.optimizer,
        )  # fmt: skip
        if self.comm_hook != "none":
            program += ["--comm-hook", self.comm_hook]
        # gloo picks the interface of the host's one cable, inside the slot's namespace
        return Launch([*torchrun, *program], env={"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"})

    def killed(self, target: int, pids: list[int], launched_pid: int) -> list[int]:
        return pids if target == COORDINATOR else [pid for pid in pids if pid != launched_pid]

    def restarts_itself(self, target: int) -> bool:
        return target != COORDINATOR
