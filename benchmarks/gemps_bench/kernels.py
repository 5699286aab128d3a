"""GEM's update alone, per kernel and state: the numbers behind `--gem-kernel auto` and the cost
of `--gem-state compact` (docs/PERFORMANCE.md).

    python -m gemps_bench.kernels [--sizes 100K,1M,10M] [--repeats 7] [--states exact,compact] [--workers 16]

One process, kernels interleaved per size, best of `repeats` commits each (the workers commit in
turn, so each commit reads another worker's state, as on a server), with the memory bandwidth the
exact update would need if it touched each of its vectors once per commit. The compiled compact
pass is timed in every build this CPU runs (avx512, avx2, baseline: `compact-avx2`, ...).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gemps_bench.counts import parse_counts
from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules import GEM_STATES, create_rule
from gemps_server.domain.rules.base import StepContext
from gemps_server.domain.rules.gem_base import GEM_KERNELS
from gemps_server.domain.rules.gem_compact import compact_builds

# theta, m_i, s_i read and written, Delta read: 7 float32 vectors per commit.
VECTORS_TOUCHED = 7


def milliseconds_per_commit(kernel: str, size: int, repeats: int, state: str = "exact", workers: int = 1) -> float:
    """Best wall time of one GEM commit of a gradient of `size` float32 parameters."""
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(size, dtype=np.float32)
    gradient = rng.standard_normal(size, dtype=np.float32) * np.float32(1e-3)
    rule = create_rule(TrainingConfig(), size, gem_state=state, gem_kernel=kernel)
    names = [f"w{index}" for index in range(workers)]
    for name in names:
        rule.add_worker(name, theta)
    for name in names:  # pages touched, caches warm
        theta, _ = rule.step(theta, gradient, StepContext(name, 0))
    best = float("inf")
    for index in range(repeats):
        started = time.perf_counter()
        theta, _ = rule.step(theta, gradient, StepContext(names[index % workers], 0))
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def cases(states: list[str]) -> list[tuple[str, str, str | None]]:
    """(label, state, compact build) for every kernel of every state; the compact compiled pass in each build."""
    found: list[tuple[str, str, str | None]] = []
    for state in states:
        for kernel in (k for k in GEM_KERNELS if k != "auto"):
            try:
                builds = compact_builds()[1] if state == "compact" and kernel == "compiled" else []
            except ValueError:  # not built: the numpy kernel stands in (create_rule says so)
                builds = []
            if builds:
                found += [(f"compact-{build}", kernel, build) for build in builds]
            else:
                found.append((kernel if state == "exact" else f"compact-{kernel}", kernel, None))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gemps_bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100K,1M,10M", help="model sizes, e.g. 100K,1M")
    parser.add_argument("--repeats", type=int, default=7, help="commits timed per kernel and size (best counts)")
    parser.add_argument("--states", default="exact", help=f"GEM states to time ({', '.join(GEM_STATES)})")
    parser.add_argument(
        "--workers", type=int, default=1, help="workers committing in turn (1: the same state each time)"
    )
    args = parser.parse_args()
    states = args.states.split(",")
    if unknown := sorted(set(states) - set(GEM_STATES)):
        parser.error(f"--states: unknown {', '.join(unknown)} (choose from {', '.join(GEM_STATES)})")
    rows = []
    for size in parse_counts(args.sizes):
        row: dict[str, float | int] = {"parameters": size, "workers": args.workers}
        for label, kernel, build in cases(states):
            chosen = None
            if build is not None:
                chosen = compact_builds()[0]
                compact_builds(build)
            try:
                state = "compact" if label.startswith("compact") else "exact"
                ms = milliseconds_per_commit(kernel, size, args.repeats, state, args.workers)
            finally:
                if chosen is not None:
                    compact_builds(chosen)
            row[f"{label}_ms"] = round(ms, 3)
            if state == "exact":
                row[f"{label}_gb_per_s"] = round(VECTORS_TOUCHED * 4 * size / ms / 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
