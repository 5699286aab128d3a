"""Which code to keep GEM's per-worker state in (issue 45, DESIGN §1a): a simulation, not gemps code.

GEM runs here in plain numpy, its workers simulated one commit at a time in a random order on the
digits CNN (real gradients from torch, each worker's from the theta its last reply gave it), with
m_i and s_i - R kept exactly and, alongside, through a quantiser; the commits follow the exact
rule ("teacher-forced": both see the same theta), so only the state differs, and pi's error per
parameter is measured directly. Quantisers: `none`, `linear:B` (int8, a peak per B values),
`float:B:M:E` (sign, exponent over E binades below the block's peak, M mantissa bits: float:4096:3:16
is --gem-state compact's e4m3 code). R, the shared reference, is refreshed (every worker's offset
re-encoded) every `--refresh` commits (0: the number of workers).

    PYTHONPATH=proto:server:client_sdk:worker .venv/bin/python scripts/gem_state_codes.py \\
        --proxy linear:256 --proxy float:256:3:16 --proxy float:4096:3:16 --offset none \\
        --out docs/results/gem_state/codes.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gemps_worker.datasets import load_digits
from gemps_worker.models import build_model

Quantiser = Callable[[np.ndarray], np.ndarray]


class DigitsWorkers:
    """`count` workers of the digits CNN, each over the training set in its own order (batch 64)."""

    def __init__(self, count: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.data = load_digits()
        self.model = build_model("digits-cnn", tuple(self.data.train_x.shape[1:]), 10, seed=seed)
        self.order = np.random.default_rng(seed)
        size = len(self.data.train_x)
        self.batches = [np.random.default_rng(seed * 100_000 + i).permutation(size) for i in range(count)]
        self.position = [0] * count
        self.images, self.labels = torch.from_numpy(self.data.train_x), torch.from_numpy(self.data.train_y)

    def initial(self) -> np.ndarray:
        flat = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach().numpy()
        return np.asarray(flat, np.float32)

    def next_worker(self) -> int:
        return int(self.order.integers(len(self.batches)))

    def gradient(self, worker: int, theta: np.ndarray) -> np.ndarray:
        """Worker `worker`'s next mini-batch gradient at `theta`."""
        batch = self.batches[worker][self.position[worker] : self.position[worker] + 64]
        self.position[worker] = (self.position[worker] + 64) % (len(self.batches[worker]) - 64)
        torch.nn.utils.vector_to_parameters(torch.from_numpy(theta), self.model.parameters())
        self.model.zero_grad()
        F.cross_entropy(self.model(self.images[batch]), self.labels[batch]).backward()  # type: ignore[no-untyped-call]
        grads = [p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None]
        return np.asarray(torch.cat(grads).numpy(), np.float32)


def blocked(values: np.ndarray, block: int) -> np.ndarray:
    padded = np.concatenate([values, np.zeros(-values.size % block, np.float32)])
    return padded.reshape(-1, block)


def linear(values: np.ndarray, block: int) -> np.ndarray:
    rows = blocked(values, block)
    scale = np.abs(rows).max(axis=1, keepdims=True) / np.float32(127)
    codes = np.rint(rows / np.where(scale == 0, 1, scale)).clip(-127, 127)
    return np.asarray((codes * scale).reshape(-1)[: values.size], np.float32)


def small_float(values: np.ndarray, block: int, mantissa: int, binades: int) -> np.ndarray:
    rows = blocked(values, block).astype(np.float64)
    peak = np.abs(rows).max(axis=1, keepdims=True)
    ratio = np.abs(rows) / np.where(peak == 0, 1, peak)
    _, exponent = np.frexp(ratio)
    step = np.ldexp(1.0, np.maximum(exponent, 1 - binades) - 1 - mantissa)
    return np.asarray((np.sign(rows) * np.rint(ratio / step) * step * peak).reshape(-1)[: values.size], np.float32)


def quantiser(spec: str) -> Quantiser:
    kind, *numbers = spec.split(":")
    if kind == "none":
        return lambda values: values
    if kind == "linear":
        return lambda values: linear(values, int(numbers[0]))
    if kind == "float":
        block, mantissa, binades = (int(n) for n in numbers)
        return lambda values: small_float(values, block, mantissa, binades)
    raise ValueError(f"unknown quantiser {spec!r} (none, linear:B, float:B:M:E)")


def simulate(proxy_spec: str, offset_spec: str, workers: int, steps: int, refresh: int, seed: int) -> dict[str, object]:
    workers_of = DigitsWorkers(workers, seed)
    theta = workers_of.initial()
    eta, mu, pi_max, eps = np.float32(0.05), np.float32(0.9), np.float32(5), np.float32(1e-16)
    quantise_proxy, quantise_offset = quantiser(proxy_spec), quantiser(offset_spec)
    proxy = [np.zeros_like(theta) for _ in range(workers)]
    seen = [theta.copy() for _ in range(workers)]
    kept_proxy = [np.zeros_like(theta) for _ in range(workers)]
    reference = theta.copy()
    kept_offset = [quantise_offset(theta - reference) for _ in range(workers)]
    held = [theta.copy() for _ in range(workers)]
    errors, exact_pis, kept_pis = [], [], []
    started = time.monotonic()
    for commit in range(workers * steps):
        i = workers_of.next_worker()
        gradient = workers_of.gradient(i, held[i])
        delta = -eta * gradient
        proxy[i] = mu * proxy[i] + delta
        kept = mu * kept_proxy[i] + delta
        pi = np.clip((np.abs(proxy[i]) - np.abs(theta - seen[i])) / (np.abs(delta) + eps), 0, pi_max)
        kept_seen = reference + kept_offset[i]
        kept_pi = np.clip((np.abs(kept) - np.abs(theta - kept_seen)) / (np.abs(delta) + eps), 0, pi_max)
        if commit >= workers * steps // 10:
            errors.append(float(np.abs(pi - kept_pi).mean()))
            exact_pis.append(pi[::7])
            kept_pis.append(kept_pi[::7])
        seen[i] = theta.copy()
        kept_proxy[i] = quantise_proxy(kept)
        kept_offset[i] = quantise_offset(theta - reference)
        theta = (theta + pi * delta).astype(np.float32)  # the exact rule's step: both see this theta
        held[i] = theta.copy()
        if (commit + 1) % (refresh or workers) == 0:
            kept_offset = [quantise_offset(offset + reference - theta) for offset in kept_offset]
            reference = theta.copy()
    exact, kept_all = np.concatenate(exact_pis), np.concatenate(kept_pis)
    return {
        "proxy": proxy_spec,
        "offset": offset_spec,
        "workers": workers,
        "steps": steps,
        "refresh": refresh or workers,
        "seed": seed,
        "pi_mean_abs_error": round(float(np.mean(errors)), 4),
        "pi_mean": [round(float(exact.mean()), 4), round(float(kept_all.mean()), 4)],
        "pi_median": [round(float(np.median(exact)), 4), round(float(np.median(kept_all)), 4)],
        "pi_p90": [round(float(np.percentile(exact, 90)), 4), round(float(np.percentile(kept_all, 90)), 4)],
        "at_zero": [round(float((exact <= 0).mean()), 3), round(float((kept_all <= 0).mean()), 3)],
        "at_max": [round(float((exact >= pi_max).mean()), 3), round(float((kept_all >= pi_max).mean()), 3)],
        "seconds": round(time.monotonic() - started, 1),
    }


def teacher_forced_rules(workers: int, steps: int, seed: int) -> dict[str, object]:
    """gemps' own rules side by side, the compact one fed the exact one's theta before every commit:
    each commit's statistics as the rules report them (mean pi over every parameter, the shares at
    0 and at pi_max), compared commit by commit and as distributions over the commits."""
    from gemps_proto.schema import PayloadKind
    from gemps_server.domain.rules.gem import GemRule
    from gemps_server.domain.rules.gem_compact import CompactGemRule

    workers_of = DigitsWorkers(workers, seed)
    theta = workers_of.initial()
    exact = GemRule(theta.size, learning_rate=0.05, momentum=0.9, kappa=1.0, pi_max=5.0, kernel="compiled")
    compact = CompactGemRule(theta.size, learning_rate=0.05, momentum=0.9, kappa=1.0, pi_max=5.0, kernel="compiled")
    for i in range(workers):
        exact.add_worker(str(i), theta)
        compact.add_worker(str(i), theta)
    held = [theta.copy() for _ in range(workers)]
    pairs = []
    for commit in range(workers * steps):
        i = workers_of.next_worker()
        gradient = workers_of.gradient(i, held[i])
        _, compact_stats = compact.step(theta.copy(), gradient, PayloadKind.GRADIENT, str(i), 0, version=commit)
        theta, exact_stats = exact.step(theta.copy(), gradient, PayloadKind.GRADIENT, str(i), 0, version=commit)
        held[i] = theta.copy()
        if commit >= workers * steps // 10:
            pairs.append((exact_stats, compact_stats))
    means = [np.array([p[k].scaling_mean for p in pairs]) for k in (0, 1)]
    zeros = [np.array([p[k].fraction_at_zero for p in pairs]) for k in (0, 1)]
    maxes = [np.array([p[k].fraction_at_max for p in pairs]) for k in (0, 1)]
    return {
        "rules": "GemRule against CompactGemRule, teacher-forced",
        "workers": workers,
        "steps": steps,
        "seed": seed,
        "commits": len(pairs),
        "pi_mean_abs_difference": round(float(np.abs(means[1] - means[0]).mean()), 4),
        "pi_mean_relative_difference": round(float(np.abs(means[1] - means[0]).mean() / means[0].mean()), 4),
        "pi_mean_median": [round(float(np.median(m)), 4) for m in means],
        "pi_mean_p90": [round(float(np.percentile(m, 90)), 4) for m in means],
        "at_zero": [round(float(z.mean()), 4) for z in zeros],
        "at_max": [round(float(m.mean()), 4) for m in maxes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", action="append", default=None, help="quantisers of m_i to try (repeat)")
    parser.add_argument("--offset", action="append", default=None, help="quantisers of s_i - R to try (repeat)")
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="commits per worker")
    parser.add_argument("--refresh", type=int, default=0, help="commits between references (0: the workers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append each result as a JSON line here")
    parser.add_argument("--rules", action="store_true", help="gemps' own rules, exact against compact, instead")
    parser.add_argument(
        "--refresh-per-worker", type=int, default=0, help="--rules: the compact rule's REFRESH_PER_WORKER (0: its own)"
    )
    args = parser.parse_args()
    if args.rules:
        if args.refresh_per_worker:
            from gemps_server.domain.rules import gem_compact

            gem_compact.REFRESH_PER_WORKER = args.refresh_per_worker
        found = {
            **teacher_forced_rules(args.workers, args.steps, args.seed),
            "refresh_per_worker": args.refresh_per_worker,
        }
        print(json.dumps(found), flush=True)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(json.dumps(found) + "\n")
        return
    for proxy_spec in args.proxy or ["none"]:
        for offset_spec in args.offset or ["none"]:
            result = simulate(proxy_spec, offset_spec, args.workers, args.steps, args.refresh, args.seed)
            print(json.dumps(result), flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as out:
                    out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
