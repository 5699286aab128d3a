"""A PyTorch DDP worker of the comparison, run by torchrun (`torchrun ... -m
gemps_bench.alternatives.systems.ddp_program`): gloo, DistributedDataParallel, the shard of its
torchrun rank, and the contract's `--optimizer`: SGD with momentum 0.9 (the momentum SGD GEM's proxy
stands for; system `ddp`) or nanoGPT's AdamW (`ddp-adamw`). `--comm-hook bf16` registers torch's
`bf16_compress_hook` (`ddp-adamw-bf16`): each bucket all-reduced in bfloat16, half the bytes.

Fault tolerance as torchrun's docs show it: rank 0 saves a checkpoint (model, optimizer, step)
every CHECKPOINT_EVERY seconds, and every worker of a (re)started group loads the newest one, so an
elastic restart resumes from there; the steps since are lost. Samples are counted applied when the
step's all-reduce is done (a step that completes on one rank completed on all).
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with the classes
# themselves, and refuses strings ("bucket annotation should be dist.GradBucket").
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, as the type checker knows it
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from gemps_bench.alternatives.contract import (
    ProgressLog,
    Snapshots,
    local_optimizer,
    parse_worker_args,
    worker_parser,
)
from gemps_bench.alternatives.workloads import loss, workload

CHECKPOINT_EVERY = 10.0
COMM_HOOKS = ("none", "bf16")


def bf16_on_gloo(process_group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook itself. DDP refuses a hook *named* bf16_compress_hook without CUDA
    and NCCL ("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+"), but gloo
    all-reduces bfloat16 on the CPU, so it is registered under this name."""
    return bf16_compress_hook(process_group, bucket)


def main() -> None:
    parser = worker_parser(__doc__ or "")
    parser.add_argument("--comm-hook", default="none", choices=COMM_HOOKS, help="bf16: torch's bf16_compress_hook")
    args = parse_worker_args(parser)
    hook = parser.parse_known_args()[0].comm_hook
    torch.set_num_threads(1)
    started = time.monotonic()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    chosen = replace(workload(args.workload), batch=args.batch)
    model = chosen.build_model()
    optimizer = local_optimizer(args.optimizer, model, args.lr)
    checkpoint = args.run_dir / "ddp-checkpoint.pt"
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    ddp = DistributedDataParallel(model)
    if hook == "bf16":
        ddp.register_comm_hook(None, bf16_on_gloo)
    log = ProgressLog(args.run_dir, args.rank)  # the rig's slot: torchrun's rank may differ after a restart
    log.wait_for_go(args.run_dir)
    snapshots = Snapshots(args.run_dir, args.snapshot_every) if rank == 0 else None
    last_checkpoint = time.monotonic()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # a new data order after each restart
    for inputs, targets in chosen.batches(rank, world, args.seed + restarts):
        if time.monotonic() - started >= args.deadline_s:
            break
        optimizer.zero_grad()
        loss(ddp, inputs, targets).backward()  # type: ignore[no-untyped-call]  # the all-reduce of the gradients
        optimizer.step()
        log.step(len(inputs), len(inputs))
        if snapshots is not None:
            snapshots.write(model)
            if time.monotonic() - last_checkpoint >= CHECKPOINT_EVERY:
                _save(checkpoint, model, optimizer)
                log.event("checkpoint")
                last_checkpoint = time.monotonic()
    log.close()
    dist.destroy_process_group()


def _save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    partial = path.with_suffix(".partial")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, partial)
    os.replace(partial, path)


if __name__ == "__main__":
    main()
