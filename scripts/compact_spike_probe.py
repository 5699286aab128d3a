"""How far a few spiking values move compact GEM's π on the other parameters (issue 61, item 8).

Exact GEM runs a sequence of commits from `--workers` workers; compact GEM is fed exact GEM's θ
before every commit, so that only the state differs, and π per parameter is read back from each
rule's step, |π_compact - π_exact|, averaged over the parameters that are not spiked (and whose
step is large enough against θ to read π from). Four cases: gradients normal or heavy-tailed
(Student's t, 1.5 degrees of freedom), with or without one worker (`--every`: every worker)
committing `--spikes` values at +-10,000 each time.

    python scripts/compact_spike_probe.py [--kernel numpy|compiled] [--every] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gemps_proto.schema import PayloadKind
from gemps_server.domain.rules import block_codes
from gemps_server.domain.rules.gem import GemRule
from gemps_server.domain.rules.gem_compact import CompactGemRule

LEARNING_RATE = 0.05
SPIKE = 1e4


def pi_error(
    *, spikes: int, every: bool, tails: str, kernel: str, size: int, workers: int, commits: int, seed: int
) -> float:
    """Mean |π_compact - π_exact| over the parameters not spiked, after the first 20 commits."""
    rng = np.random.default_rng(seed)
    exact, compact = (
        rule(size, learning_rate=LEARNING_RATE, momentum=0.9, kappa=1.0, pi_max=5.0, kernel=kernel)
        for rule in (GemRule, CompactGemRule)
    )
    theta = rng.standard_normal(size).astype(np.float32)
    for index in range(workers):
        exact.add_worker(f"w{index}", theta)
        compact.add_worker(f"w{index}", theta)
    spiked = rng.choice(size, spikes, replace=False)
    others = np.ones(size, bool)
    others[spiked] = False
    scales = np.exp2(rng.uniform(-8, 0, size))
    errors = []
    for version in range(commits):
        draw = rng.standard_normal(size) if tails == "normal" else rng.standard_t(1.5, size)
        gradient = (draw * scales).astype(np.float32)
        worker = f"w{rng.integers(workers)}"
        if spikes and (every or worker == "w0"):
            gradient[spiked] = rng.choice([-SPIKE, SPIKE], spikes)
        after_exact, _ = exact.step(theta.copy(), gradient, PayloadKind.GRADIENT, worker, 3, version=version)
        after_compact, _ = compact.step(theta.copy(), gradient, PayloadKind.GRADIENT, worker, 3, version=version)
        delta = -LEARNING_RATE * gradient.astype(np.float64)
        readable = others & (np.abs(delta) > 2.0**-10 * np.abs(theta))
        if version >= 20:
            errors.append((np.abs(after_compact.astype(np.float64) - after_exact) / np.abs(delta))[readable].mean())
        theta = after_exact
    return float(np.mean(errors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["numpy", "compiled"], default="compiled")
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--commits", type=int, default=200)
    parser.add_argument("--spikes", type=int, default=4)
    parser.add_argument("--every", action="store_true", help="every worker's commits spike, not one worker's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    arguments = parser.parse_args()
    common = {
        "kernel": arguments.kernel,
        "size": arguments.size,
        "workers": arguments.workers,
        "commits": arguments.commits,
        "seed": arguments.seed,
        "every": arguments.every,
    }
    rows = []
    print(f"blocks of {block_codes.BLOCK}; mean |pi_compact - pi_exact| on the parameters not spiked")
    for tails in ("normal", "t1.5"):
        without = pi_error(spikes=0, tails=tails, **common)
        with_spikes = pi_error(spikes=arguments.spikes, tails=tails, **common)
        rows.append({"tails": tails, "without": without, "with": with_spikes, "ratio": with_spikes / without})
        ratio = with_spikes / without
        print(f"{tails:7} without spikes {without:.4f}  with {with_spikes:.4f}  x{ratio:.2f}", flush=True)
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({"block": block_codes.BLOCK, **common, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
