"""One rank of a gloo process group training a DDP-wrapped Linear through RemoteOptimizer, for the
tests of a process group as one gemps worker (tests/integration/test_torch_wrappers.py).

    python -m tests.ddp_worker --rank 0 --world 2 --port 29500 --target 127.0.0.1:50051 \
        --steps 3 --out rank0.json [--fsdp]

Each rank feeds its own batch (rank r's inputs are all r + 1), so DDP's all-reduced gradient differs
from either rank's own. It writes `--out` (JSON): per step θ before, the all-reduced gradient and θ
after, the version, the names the server holds; with `--fsdp`, the error RemoteOptimizer raised for
an FSDP model instead. `--given inner` gives RemoteOptimizer the model inside the DDP wrapper,
`--given separate` an unwrapped model with process_group=None (each rank its own gemps worker);
`--poison` makes the last step's inputs NaN, which gemps refuses (the record says how each rank
failed), `--poison-step K` step K's (from 0); `--overlap` keeps one commit in flight
(RemoteOptimizer(..., overlap=True)), and the record ends with θ after the last commit was flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemps.pytorch import RemoteOptimizer


def run(
    rank: int, world: int, target: str, steps: int, fsdp: bool, given: str, poisoned: int, overlap: bool = False
) -> dict[str, Any]:
    torch.manual_seed(rank)  # different on each rank: DDP broadcasts rank 0's at wrapping
    model = nn.Linear(3, 1)
    if fsdp:
        # FSDP2: FullyShardedDataParallel (FSDP1) needs an accelerator, fully_shard runs on the CPU.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        try:
            sharded = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            assert isinstance(sharded, nn.Module)
            RemoteOptimizer(sharded, target, threads=None)
        except Exception as error:  # what the test reads
            return {"refused": f"{type(error).__name__}: {error}"}
        return {"refused": ""}
    ddp: nn.Module = nn.parallel.DistributedDataParallel(model)
    if given == "separate":  # each rank its own worker, training apart
        ddp = model
        optimizer = RemoteOptimizer(model, target, threads=None, process_group=None)
    else:  # the DDP wrapper, or the model inside it
        optimizer = RemoteOptimizer(ddp if given == "ddp" else model, target, threads=None, overlap=overlap)
    record: dict[str, Any] = {"steps": [], "registered_version": optimizer.version}
    for step in range(steps):
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        optimizer.zero_grad()
        value = float("nan") if step == poisoned else float(rank + 1)  # a NaN gradient: refused
        loss = ddp(torch.full((2, 3), value)).sum()
        loss.backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).tolist()
        try:
            optimizer.step(loss=loss)
        except Exception as error:  # every rank hears the leader's failure, none waits for ever
            record["failed"] = f"{type(error).__name__}: {error}"
            break
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        record["steps"].append({"before": before, "gradient": gradient, "after": after, "version": optimizer.version})
    if overlap:
        optimizer.remote.flush()  # every rank: the last commit's reply loaded
        record["flushed"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    record["learning_rate"] = optimizer.learning_rate
    if rank == 0 or given == "separate":
        record["names"] = [entry.name for entry in optimizer.remote.client.spec]
    else:
        try:
            optimizer.remote.client  # noqa: B018 (what a rank without the client reads)
        except Exception as error:
            record["client"] = str(error)
    dist.barrier()  # every rank stepped before rank 0 leaves the server
    optimizer.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--poison", action="store_true", help="the last step's inputs NaN: refused")
    parser.add_argument("--poison-step", type=int, default=-1, help="this step's inputs NaN (from 0)")
    parser.add_argument("--given", choices=["ddp", "inner", "separate"], default="ddp", help="to RemoteOptimizer")
    parser.add_argument("--overlap", action="store_true", help="one commit in flight while the next step computes")
    args = parser.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    try:
        poisoned = args.steps - 1 if args.poison else args.poison_step
        record = run(args.rank, args.world, args.target, args.steps, args.fsdp, args.given, poisoned, args.overlap)
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as out:
        json.dump(record, out)
    # Leave without the interpreter's finalization. Once a model was wrapped in DDP,
    # destroy_process_group leaves the gloo group alive (torch 2.13: its worker threads still run),
    # and a worker thread that releases a tensor owning a Python object while the interpreter
    # finalizes dies taking the GIL, in std::terminate (pytorch/pytorch#190489): a rank aborted so
    # once under CI's load ("terminate called without an active exception", nothing else). What a
    # normal exit would still wait for, a thread of ours, fails instead.
    running = [
        thread.name for thread in threading.enumerate() if not thread.daemon and thread is not threading.main_thread()
    ]
    if running:
        print(f"threads still running at exit: {running}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if running else 0)


if __name__ == "__main__":
    main()
