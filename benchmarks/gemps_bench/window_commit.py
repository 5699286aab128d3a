"""What a `LocalSteps` window's commit costs the worker at a model's size (docs/RESULTS.md, "On a GPU").

On a lent H200 the 85M-parameter GPT-2 job spent 96 % of a worker's step in its commits (3.1 s
each). This measures that commit alone, on CPU: a model of `--params` parameters (square linear
layers of 1,024, random gradients, no forward), an AdamW step and the window's commit to a real
`gemps server --rule downpour`, int8 both ways by default, `--commits` times. It prints the
seconds of each commit and the process's user and system CPU over the measured ones (a θ-sized
array the worker allocates arrives as fresh pages the kernel faults in, which shows as system
time), and the server's CPU a commit, spent while the worker waits for its reply.

    python -m gemps_bench.window_commit --params 85M --commits 7
    PYTHONPATH=<tree's packages> python benchmarks/gemps_bench/window_commit.py ...   # another tree's SDK
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time
from typing import Any

import torch

from gemps.pytorch import LocalSteps
from gemps_bench import procfs
from gemps_bench.counts import parse_counts
from gemps_worker.cluster import ServerProcess

WIDTH = 1024  # the layers are WIDTH x WIDTH, no bias
WARM_COMMITS = 2  # the first commits register and start the reply copy: not measured


def model_of(parameters: int) -> torch.nn.Module:
    """Square layers of WIDTH (one narrower layer below WIDTH² parameters), about `parameters` in all."""
    torch.manual_seed(0)
    width = min(WIDTH, max(1, math.isqrt(parameters)))
    layers = max(1, round(parameters / width**2))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def cpu_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def server_cpu_seconds(pid: int) -> float:
    """The server's CPU so far, user and system: its process and its partitions' (procfs)."""
    return sum(procfs.cpu_seconds(each) or 0.0 for each in (pid, *procfs.children(pid)))


def measure(parameters: int, commits: int, compression: str, partitions: int) -> dict[str, Any]:
    """Each measured commit's seconds (the step that commits: AdamW's step, then the commit and its
    reply loaded), the worker's user and system CPU seconds a commit and the server's CPU seconds a
    commit (it decodes, applies and codes the reply while the worker waits), over the measured ones."""
    model = model_of(parameters)
    codes = None if compression == "none" else compression
    with ServerProcess(rule="downpour", partitions=partitions) as server:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with LocalSteps(model, inner, server.target, compression=codes, reply_compression=codes) as optimizer:
            for parameter in model.parameters():
                parameter.grad = torch.randn_like(parameter) * 1e-3
            seconds = []
            for commit in range(WARM_COMMITS + commits):
                if commit == WARM_COMMITS:
                    user, system = cpu_seconds()
                    served = server_cpu_seconds(server.pid)
                began = time.perf_counter()
                optimizer.step(loss=1.0)  # steps=1: every step commits
                seconds.append(time.perf_counter() - began)
            user_after, system_after = cpu_seconds()
            served_after = server_cpu_seconds(server.pid)
    measured = seconds[WARM_COMMITS:]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "compression": compression,
        "partitions": partitions,
        "commit_seconds": measured,
        "median_commit_seconds": statistics.median(measured),
        "user_cpu_seconds_a_commit": (user_after - user) / commits,
        "system_cpu_seconds_a_commit": (system_after - system) / commits,
        "server_cpu_seconds_a_commit": (served_after - served) / commits,
    }


def count(text: str) -> int:
    """One size as people write it ('85M', '100K'): gemps_bench.counts' reading."""
    try:
        numbers = parse_counts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if len(numbers) != 1:
        raise argparse.ArgumentTypeError(f"one size, not {len(numbers)}: {text!r}")
    return numbers[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=count, default=count("85M"), help="the model's size (85M, 100K, ...)")
    parser.add_argument("--commits", type=int, default=5, help="commits measured, after two that are not")
    parser.add_argument("--compression", choices=("int8", "int4", "none"), default="int8", help="both ways")
    parser.add_argument("--partitions", type=int, default=1)
    args = parser.parse_args()
    if args.commits < 1:
        parser.error(f"--commits must be at least 1, not {args.commits}")
    print(json.dumps(measure(args.params, args.commits, args.compression, args.partitions), indent=1))


if __name__ == "__main__":
    main()
