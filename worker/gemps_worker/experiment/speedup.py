"""How many workers pay, measured: samples and commits to a held-out loss target against N.

`gemps experiment --suite speedup` trains one small model with N workers of batch b, for each N,
rule and seed, to a fixed held-out loss, and counts the commits and samples it took. McCandlish
et al. (2018) predict, for batch B = N*b, steps S = S_min (1 + B_crit/B) and samples
E = E_min (1 + B/B_crit), B_crit = E_min/S_min: the knee past which more workers buy no fewer
steps. speedup_fit.py fits that to the counts and sets it beside the server's noise-scale gauge
(Status.gradient_noise, read during the runs).

Kept small for 2 cores, counting samples rather than seconds: a numpy MLP on digits (or MNIST IDX
files where present), and N workers in one thread taking turns (worker i commits the gradient of
its next batch at the θ its own last reply carried): every commit is computed N-1 commits before
it lands, the staleness of N equally fast asynchronous workers, without N processes. Each run has
its own `gemps server` process (a fresh θ), reached with the SDK like any worker.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gemps import Client
from gemps_worker.cluster import ServerProcess
from gemps_worker.datasets import Dataset, load_dataset

WORKERS = (1, 2, 4, 8, 16, 32, 64)
RULES = ("gem", "downpour", "adaptive-staleness")


@dataclass(frozen=True)
class SpeedupConfig:
    rules: tuple[str, ...] = RULES
    workers: tuple[int, ...] = WORKERS
    seeds: int = 3
    batch_size: int = 4  # b: small, so the knee (B_crit/b workers) falls inside the range of N
    learning_rate: float = 0.05
    target_loss: float = 0.3  # held-out cross-entropy
    max_samples: int = 100_000  # a run that has not reached the target by then is counted as not reaching it
    diverged_loss: float = 10.0  # a held-out loss past this (or not finite) ends a run as not reaching it
    hidden: int = 32
    dataset: str = "digits"
    status_every: int = 50  # commits between reads of the noise-scale gauge (Status)


@dataclass(frozen=True)
class SpeedupRun:
    rule: str
    workers: int
    seed: int
    batch_size: int
    reached: bool
    commits: int  # to the target (or all of them, when not reached)
    samples: int
    seconds: float
    noise_scales: list[float] = field(default_factory=list)  # the gauge's B_noise, read every status_every commits
    final_loss: float = math.nan

    @property
    def steps(self) -> float:
        """S: commits per worker, the steps N workers in parallel take."""
        return self.commits / self.workers


class Mlp:
    """A one-hidden-layer tanh network with softmax cross-entropy, on a flat float32 θ."""

    def __init__(self, inputs: int, hidden: int, classes: int) -> None:
        self.shapes = ((inputs, hidden), (hidden,), (hidden, classes), (classes,))
        self.size = sum(math.prod(shape) for shape in self.shapes)

    def initial(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        parts = [rng.normal(scale=1 / math.sqrt(s[0]), size=s) if len(s) == 2 else np.zeros(s) for s in self.shapes]
        return np.concatenate([p.reshape(-1) for p in parts]).astype(np.float32)

    def _unpack(self, theta: np.ndarray) -> list[np.ndarray]:
        parts, at = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            parts.append(theta[at : at + n].reshape(shape))
            at += n
        return parts

    def loss(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        return self.loss_and_gradient(theta, x, y, gradient=False)[0]

    def loss_and_gradient(
        self, theta: np.ndarray, x: np.ndarray, y: np.ndarray, gradient: bool = True
    ) -> tuple[float, np.ndarray]:
        w1, b1, w2, b2 = self._unpack(theta)
        hidden = np.tanh(x @ w1 + b1)
        logits = hidden @ w2 + b2
        logits -= logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        rows = np.arange(len(y))
        loss = float(-np.log(probabilities[rows, y] + 1e-12).mean())
        if not gradient:
            return loss, theta[:0]
        d_logits = probabilities
        d_logits[rows, y] -= 1.0
        d_logits /= len(y)
        d_hidden = (d_logits @ w2.T) * (1.0 - hidden * hidden)
        parts = (x.T @ d_hidden, d_hidden.sum(axis=0), hidden.T @ d_logits, d_logits.sum(axis=0))
        return loss, np.concatenate([p.reshape(-1) for p in parts]).astype(np.float32)


def flat_data(dataset: Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train x, train y, test x, test y) with each input a flat vector."""
    return (
        dataset.train_x.reshape(len(dataset.train_x), -1),
        dataset.train_y,
        dataset.test_x.reshape(len(dataset.test_x), -1),
        dataset.test_y,
    )


def run_one(config: SpeedupConfig, rule: str, workers: int, seed: int, log_folder: Path | None = None) -> SpeedupRun:
    """One run: a fresh server, `workers` workers taking turns, until the held-out target."""
    train_x, train_y, test_x, test_y = flat_data(load_dataset(config.dataset))
    model = Mlp(train_x.shape[1], config.hidden, int(train_y.max()) + 1)
    theta0 = model.initial(seed)
    b = config.batch_size
    if log_folder is not None:
        log_folder.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(
        log_path=None if log_folder is None else log_folder / f"{rule}-n{workers}-s{seed}.log",
        rule=rule,
        learning_rate=config.learning_rate,
        batch_size=b,
        max_workers=max(workers, 2),
        lease_ttl=3600.0,
        data_plane="off",  # 64 clients' data-plane connections and shared memory would outweigh θ's 10 KB
    )
    clients: list[Client] = []
    started = time.perf_counter()
    with server:
        try:
            for i in range(workers):
                clients.append(Client(server.target, name=f"w{i}", plane="grpc", timeout=30.0))
            for client in clients:  # the first one's values initialise θ
                client.register({"theta": theta0})
            thetas = [theta0.copy() for _ in clients]
            orders = [np.random.default_rng(seed * 100_000 + i) for i in range(workers)]
            noise_scales: list[float] = []
            commits, loss, reached = 0, math.inf, False
            while commits * b < config.max_samples:
                i = commits % workers
                batch = orders[i].integers(0, len(train_x), size=b)
                batch_loss, g = model.loss_and_gradient(thetas[i], train_x[batch], train_y[batch])
                result = clients[i].commit(g, loss=batch_loss, num_samples=b)
                thetas[i] = np.array(result.parameters.flat)
                commits += 1
                loss = model.loss(thetas[i], test_x, test_y)
                if commits % config.status_every == 0:
                    noise_scales.append(clients[0].status().gradient_noise.scale)
                if loss <= config.target_loss:
                    reached = True
                    break
                if not loss <= config.diverged_loss:  # NaN too
                    break
            noise_scales.append(clients[0].status().gradient_noise.scale)
        finally:
            for client in clients:
                client.close()
    return SpeedupRun(
        rule, workers, seed, b, reached, commits, commits * b, time.perf_counter() - started, noise_scales, loss
    )


def run_all(
    config: SpeedupConfig, out: Path, force: bool = False, progress: Callable[[str], None] = print
) -> list[SpeedupRun]:
    """Every (rule, N, seed), each result kept in OUT/runs.jsonl (resumable: finished ones are reused)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    done = {} if force or not path.exists() else {_key(run): run for run in load_runs(path)}
    runs = []
    for rule in config.rules:
        for workers in config.workers:
            for seed in range(config.seeds):
                key = (rule, workers, seed)
                if key not in done:
                    done[key] = run_one(config, rule, workers, seed, out / "logs")
                    with path.open("a") as file:
                        file.write(json.dumps(asdict(done[key])) + "\n")
                run = done[key]
                runs.append(run)
                scale = _median(run.noise_scales)
                progress(
                    f"{rule:<18} N={workers:<3} seed {seed}: {'reached' if run.reached else 'NOT reached'} after "
                    f"{run.commits} commits, {run.samples} samples ({run.seconds:.0f}s); gauge B_noise ≈ {scale:.3g}"
                )
    return runs


def load_runs(path: Path) -> list[SpeedupRun]:
    return [SpeedupRun(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _key(run: SpeedupRun) -> tuple[str, int, int]:
    return run.rule, run.workers, run.seed


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan
