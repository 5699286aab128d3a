"""GEM's update alone, per kernel: the numbers behind `--gem-kernel auto` (docs/PERFORMANCE.md).

    python -m gemps_bench.kernels [--sizes 100K,1M,10M] [--repeats 7]

One process, kernels interleaved per size, best of `repeats` commits each, with the memory
bandwidth the update would need if it touched each of its five vectors once per commit.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gemps_bench.suite import parse_counts
from gemps_proto.schema import PayloadKind, TrainingConfig
from gemps_server.domain.rules import create_rule
from gemps_server.domain.rules.gem import GEM_KERNELS

# theta, m_i, s_i read and written, Delta read: 7 float32 vectors per commit.
VECTORS_TOUCHED = 7


def milliseconds_per_commit(kernel: str, size: int, repeats: int) -> float:
    """Best wall time of one GEM commit of a gradient of `size` float32 parameters."""
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(size, dtype=np.float32)
    gradient = rng.standard_normal(size, dtype=np.float32) * np.float32(1e-3)
    rule = create_rule(TrainingConfig(), size, kernel=kernel)
    rule.add_worker("w", theta)
    theta, _ = rule.step(theta, gradient, PayloadKind.GRADIENT, "w", 0)  # pages touched, caches warm
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        theta, _ = rule.step(theta, gradient, PayloadKind.GRADIENT, "w", 0)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gemps_bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100K,1M,10M", help="model sizes, e.g. 100K,1M")
    parser.add_argument("--repeats", type=int, default=7, help="commits timed per kernel and size (best counts)")
    args = parser.parse_args()
    kernels = [k for k in GEM_KERNELS if k != "auto"]
    rows = []
    for size in parse_counts(args.sizes):
        row: dict[str, float | int] = {"parameters": size}
        for kernel in kernels:
            ms = milliseconds_per_commit(kernel, size, args.repeats)
            row[f"{kernel}_ms"] = round(ms, 3)
            row[f"{kernel}_gb_per_s"] = round(VECTORS_TOUCHED * 4 * size / ms / 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
