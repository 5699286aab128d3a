"""Overlapped commits with a model on a GPU (issue 59, item 3), over loopback to a real server.

The CPU tests hold the overlap's logic; what only a GPU shows is the CUDA path: the gradients
copied into pinned staging vectors asynchronously, the commit thread waiting on their events
rather than the training thread synchronising the device, and θ from the reply loaded back. For a
model on `cuda`, each round alternates a waiting worker (`overlap=False`) and an overlapping one
on a fresh `gemps server`, and reports:

- steps per second, and the mean time the training thread spent inside `step()`;
- that the model holds θ of the server's newest version after `flush()`, bit for bit;
- the staleness the server counted (0 for the waiting worker, 1 with overlap: one worker).

    python scripts/gpu_check.py [--width 2048] [--batch 8192] [--steps 40] [--rounds 2] [--json out.json]

It runs where there is no GPU too (`--device cpu`), as a check of the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gemps
from gemps.pytorch import RemoteOptimizer
from gemps_worker.cluster import ServerProcess


def model_of(width: int, device: torch.device) -> nn.Module:
    """An MLP of 3 hidden layers of `width` (4 x width^2 parameters, about)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
    ).to(device)  # fmt: skip


def batch_of(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.batch, 256, device=device, generator=generator)
    return x, torch.randint(0, 10, (args.batch,), device=device, generator=generator)


def synchronized_now(device: torch.device) -> float:
    """perf_counter() once the device has done what was queued (a timing's start or end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def compute_ms(args: argparse.Namespace, device: torch.device) -> float:
    """A step's forward and backward alone (no commit), in milliseconds: what overlap can hide."""
    model = model_of(args.width, device)
    x, y = batch_of(args, device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = synchronized_now(device)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
    return 1000 * (synchronized_now(device) - started) / float(args.steps)


def run(overlap: bool, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """One worker's `args.steps` steps through a fresh server; its figures and checks."""
    with ServerProcess(rule="gem", learning_rate=0.01) as server:
        model = model_of(args.width, device)
        x, y = batch_of(args, device)
        inside: list[float] = []
        staleness: list[int] = []
        with RemoteOptimizer(model, server.target, overlap=overlap) as optimizer:
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    started = synchronized_now(device)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                entered = time.perf_counter()
                optimizer.step(loss=loss)
                if step >= args.warmup:
                    inside.append(time.perf_counter() - entered)
                result = optimizer.last_result
                if result is not None and step >= args.warmup:
                    staleness.append(result.staleness)
            last = optimizer.remote.flush()
            seconds = synchronized_now(device) - started
            local = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()
        with gemps.Client(server.target) as observer:
            central = observer.pull()
    held = last.version if last is not None else optimizer.remote.version
    return {
        "overlap": overlap,
        "device": str(device),
        "parameters": int(local.size),
        "steps_per_s": round(args.steps / seconds, 2),
        "step_call_ms": round(1000 * statistics.fmean(inside), 2),
        "staleness": sorted(set(staleness)),
        "model_is_newest_theta": bool(central.version == held and np.array_equal(local, central.flat)),
        "version": central.version,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the runs here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    runs = []
    compute = compute_ms(args, device)
    print(f"forward and backward alone: {compute:.2f} ms a step", flush=True)
    for round_number in range(args.rounds):
        for overlap in (False, True):
            found = run(overlap, args, device)
            runs.append({"round": round_number, **found})
            print(json.dumps(runs[-1]), flush=True)
    waiting = [r["steps_per_s"] for r in runs if not r["overlap"]]
    overlapping = [r["steps_per_s"] for r in runs if r["overlap"]]
    ratio = statistics.fmean(overlapping) / statistics.fmean(waiting)  # type: ignore[arg-type]
    waiting_ms = 1000 / statistics.fmean(waiting)  # type: ignore[arg-type]
    commit_ms = max(waiting_ms - compute, 0.0)
    best = waiting_ms / max(compute, commit_ms, 1e-9)  # compute and commit wholly overlapped
    print(f"overlap / waiting steps per second: {ratio:.2f}x on {device} (at best {best:.2f}x: compute "
          f"{compute:.1f} ms, commit {commit_ms:.1f} ms a step)")  # fmt: skip
    if args.json is not None:
        figures = {"runs": runs, "ratio": ratio, "compute_ms": compute, "commit_ms": commit_ms, "best_ratio": best}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    exact = all(r["model_is_newest_theta"] for r in runs)
    print("the model held the newest θ after every flush" if exact else "MISMATCH: a model did not hold the newest θ")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
