"""The gradient noise scale's cost, A/B in one run: the applier's CPU per commit (ServerState.commit:
validation, the rule's pass, the ledger) with the estimate (--noise-window 0) and without it
(--noise-window 1), in pairs of commits on one state, in an order drawn at random per pair, so the
machine's other load and the commit's position fall on both alike. `--null` measures the estimate
off against off: what the method reads when there is nothing to find.

    .venv/bin/python scripts/noise_cost.py --parameters 1000000 --workers 8 --commits 400

Prints each side's median and p10 CPU milliseconds per commit and their difference, the mean of
the commit-by-commit differences with its standard error. Results:
docs/PERFORMANCE.md ("The gradient noise scale"); `gemps bench --systems gemps,gemps-no-noise`
measures the same end to end, transport included, more noisily on a shared machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig
from gemps_proto.schema_proto import tensor_from_proto, tensor_to_proto
from gemps_proto.tensor_codec import EncodedTensor
from gemps_server.domain.noise import NOISE_WINDOW_AUTO, NOISE_WINDOW_OFF, NoiseEstimator
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry


def encoded(values: np.ndarray) -> EncodedTensor:
    return tensor_from_proto(tensor_to_proto(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parameters", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=8, help="registered workers: the window's k (default 8)")
    parser.add_argument("--commits", type=int, default=400, help="commits to each side (default 400)")
    parser.add_argument("--rule", default="gem")
    parser.add_argument("--null", action="store_true", help="the estimate off on both sides (the method's noise)")
    parser.add_argument(
        "--mirror",
        action="store_true",
        help="θ also written to a reply buffer as the rule computes it, as for a data-plane commit (default: "
        "gRPC's path, the reply framed from θ afterwards)",
    )
    args = parser.parse_args()
    size = args.parameters
    rng = np.random.default_rng(0)
    theta = encoded(rng.normal(size=size).astype(np.float32))
    payloads = [encoded(rng.normal(scale=1e-3, size=size).astype(np.float32)) for _ in range(8)]
    # One state (the same θ, rule state and memory) commits with its estimator and without it, in
    # turn: two states measured apart differed by ±5% either way from where their arrays landed.
    state = ServerState(
        TrainingConfig(rule=args.rule),
        WorkerRegistry(max_workers=args.workers, lease_ttl=3600),
        RuleRuntime(gem_kernel="auto"),
    )
    spec = [ParameterSpec("w", (size,))]
    workers = [state.register(f"w{i}", spec, theta).worker.worker_id for i in range(args.workers)]
    measured = NOISE_WINDOW_OFF if args.null else NOISE_WINDOW_AUTO
    estimators = {"with": NoiseEstimator(measured), "without": NoiseEstimator(NOISE_WINDOW_OFF)}
    spent: dict[str, list[float]] = {name: [] for name in estimators}
    out = np.empty(size, dtype=np.float32) if args.mirror else None  # the data plane's: θ written to the reply
    # Each pair of commits runs both, in an order drawn at random: a fixed order (with on even
    # commits) read up to ±5% with the estimate off on both sides, from what differs by position.
    order = np.random.default_rng(1)
    for _ in range(args.commits):
        pair = ("with", "without") if order.random() < 0.5 else ("without", "with")
        for name in pair:
            state.noise = estimators[name]
            worker = workers[len(spent[name]) % len(workers)]
            commit = Commit(worker, state.version, PayloadKind.GRADIENT, payloads[state.version % 8])
            started = time.process_time()
            state.commit(commit, out)
            spent[name].append(time.process_time() - started)
    skip = len(spent["with"]) // 10  # the first tenth warms caches and allocations
    kept = {name: np.array(values[skip:]) * 1e3 for name, values in spent.items()}
    for name, values in kept.items():
        print(f"{name:8s} the estimate: median {np.median(values):.3f} ms, p10 {np.percentile(values, 10):.3f} ms")
    paired = kept["with"] - kept["without"]  # each with its pair's other: the machine's load cancels out
    error = paired.std() / np.sqrt(paired.size)
    base = float(np.mean(kept["without"]))
    estimate = estimators["with"].estimate
    print(
        f"difference {paired.mean():+.4f} ± {error:.4f} ms per commit (mean of pairs ± standard error), "
        f"{paired.mean() / base:+.1%} of {base:.3f} ms; {estimate.windows} windows of {estimate.window}"
    )


if __name__ == "__main__":
    main()
