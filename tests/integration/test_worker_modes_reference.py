"""Each worker mode's commits against a plain reference implementation of its paper's equations
(issue 14): two reference workers of a tiny softmax-regression model train against a real
server in a fixed interleaving, and the central variable after every commit must equal what the
equations give, computed here in float64 numpy with hand-written gradients (no torch, no SDK).

- AGN (Hermans et al. 2017, the AGN worker; rule downpour): lambda local SGD steps from the
  pulled theta0, commit (theta_lambda - theta0) / lambda, continue from the reply's theta.
- DynSGD (the AGN paper's DynSGD server and worker; rule adaptive-staleness): commit
  theta_lambda - theta0; the server adds it divided by tau + 1, tau = its version now minus the
  version the worker last pulled.
- Asynchronous EASGD (Zhang et al. 2015, Algorithm 1; rule downpour): at step t with x the
  local variable, when tau divides t: e = alpha (x - centre), x <- x - e, centre <- centre + e;
  then x <- x - eta g(x), the gradient at x before the elastic move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from gemps.pytorch import RemoteModel
from gemps_worker.modes import AgnMode, Committed, DynSgdMode, EasgdMode, TrainingMode
from tests.integration.conftest import StartServer

FEATURES, CLASSES, BATCH = 4, 3, 8
ETA = 0.2
# Which worker takes its next mini-batch, in order: worker 0 runs ahead, so commits are stale.
SCHEDULE = [0, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 1]


def batches(worker: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(100 + worker)
    return [
        (rng.standard_normal((BATCH, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, BATCH))
        for _ in range(count)
    ]


def gradient(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """d mean cross-entropy / d theta for logits = x W^T + b, theta = [W row by row, b] (torch's
    parameters_to_vector order for nn.Linear)."""
    weight = theta[: CLASSES * FEATURES].reshape(CLASSES, FEATURES)
    bias = theta[CLASSES * FEATURES :]
    logits = x.astype(np.float64) @ weight.T + bias
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return np.concatenate([(p.T @ x).reshape(-1), p.sum(axis=0)])


@dataclass
class ReferenceWorker:
    theta: np.ndarray  # the local variable
    pulled: np.ndarray  # theta0: the central variable it last received
    pulled_version: int
    steps: int = 0  # local steps since the last commit (AGN, DynSGD) or in all (EASGD)
    batches: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


class ReferenceServer:
    """The central variable and its version, and one step of a worker by the paper's equations."""

    def __init__(self, theta: np.ndarray) -> None:
        self.theta = theta.astype(np.float64)
        self.version = 0
        self.after_commits: list[np.ndarray] = []

    def add(self, update: np.ndarray) -> None:
        self.theta = self.theta + update
        self.version += 1
        self.after_commits.append(self.theta.copy())


def accumulated_step(
    server: ReferenceServer, worker: ReferenceWorker, batch: int, local_steps: int, divided: bool, stale_scaled: bool
) -> None:
    """AGN (divided by lambda, plain add) or DynSGD (undivided, the server divides by tau + 1)."""
    x, y = worker.batches[batch]
    worker.theta = worker.theta - ETA * gradient(worker.theta, x, y)
    worker.steps += 1
    if worker.steps < local_steps:
        return
    update = worker.theta - worker.pulled
    if divided:
        update = update / local_steps
    if stale_scaled:
        update = update / (server.version - worker.pulled_version + 1)
    server.add(update)
    worker.theta, worker.pulled, worker.pulled_version = server.theta.copy(), server.theta.copy(), server.version
    worker.steps = 0


def easgd_step(server: ReferenceServer, worker: ReferenceWorker, batch: int, alpha: float, period: int) -> None:
    x_data, y = worker.batches[batch]
    x = worker.theta.copy()
    if worker.steps % period == 0:
        elastic = alpha * (x - server.theta)
        worker.theta = worker.theta - elastic
        server.add(elastic)
    worker.theta = worker.theta - ETA * gradient(x, x_data, y)
    worker.steps += 1


Batches = list[tuple[np.ndarray, np.ndarray]]


def run_against_server(
    start_server: StartServer, rule: str, make_mode: Callable[[RemoteModel], TrainingMode]
) -> tuple[np.ndarray, list[tuple[np.ndarray, int]], list[Batches]]:
    """An accumulating mode in the interleaving against a real server: the initial theta, each
    commit's central variable and version in order, and each worker's batches."""
    server = start_server(rule=rule, learning_rate=ETA)
    torch.manual_seed(0)
    models = [torch.nn.Linear(FEATURES, CLASSES) for _ in range(2)]
    data = [batches(w, SCHEDULE.count(w)) for w in range(2)]
    commits: list[tuple[np.ndarray, int]] = []
    with RemoteModel(models[0], server.target) as first, RemoteModel(models[1], server.target) as second:
        initial = first.parameters_vector().numpy().astype(np.float64)
        for _w, committed in interleave(models, [make_mode(first), make_mode(second)], data):
            if committed is not None:
                commits.append((committed.result.parameters.flat.astype(np.float64), committed.result.version))
    return initial, commits, data


def interleave(
    models: Sequence[torch.nn.Module], modes: Sequence[TrainingMode], data: list[Batches]
) -> Iterator[tuple[int, Committed | None]]:
    """Each worker's next mini-batch in SCHEDULE's order: (the worker, what it committed, if anything)."""
    taken = [0, 0]
    for w in SCHEDULE:
        x, y = data[w][taken[w]]
        taken[w] += 1
        model = models[w]

        def loss(model: torch.nn.Module = model, x: np.ndarray = x, y: np.ndarray = y) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))

        yield w, modes[w].on_batch(loss, BATCH)


def reference(initial: np.ndarray, data: list[Batches]) -> tuple[ReferenceServer, list[ReferenceWorker]]:
    server = ReferenceServer(initial)
    workers = [ReferenceWorker(initial.copy(), initial.copy(), 0, batches=data[w]) for w in range(2)]
    return server, workers


@pytest.mark.parametrize(("local_steps"), [1, 3])
def test_agn_commits_follow_the_papers_equations(start_server: StartServer, local_steps: int) -> None:
    initial, commits, data = run_against_server(
        start_server, "downpour", lambda remote: AgnMode(remote, ETA, local_steps)
    )
    server, workers = reference(initial, data)
    taken = [0, 0]
    for w in SCHEDULE:
        accumulated_step(server, workers[w], taken[w], local_steps, divided=True, stale_scaled=False)
        taken[w] += 1
    assert len(commits) == len(server.after_commits) > 2
    for (theta, _version), expected in zip(commits, server.after_commits, strict=True):
        np.testing.assert_allclose(theta, expected, rtol=1e-4, atol=1e-5)
    assert [v for _, v in commits] == list(range(1, len(commits) + 1))


def test_dynsgd_commits_follow_the_papers_equations(start_server: StartServer) -> None:
    local_steps = 2
    initial, commits, data = run_against_server(
        start_server, "adaptive-staleness", lambda remote: DynSgdMode(remote, ETA, local_steps)
    )
    server, workers = reference(initial, data)
    taken = [0, 0]
    stalenesses = []
    for w in SCHEDULE:
        before = server.version
        pulled = workers[w].pulled_version
        accumulated_step(server, workers[w], taken[w], local_steps, divided=False, stale_scaled=True)
        if server.version > before:
            stalenesses.append(before - pulled)
        taken[w] += 1
    assert max(stalenesses) >= 1  # the interleaving makes some commits stale: 1/(tau+1) matters
    assert len(commits) == len(server.after_commits) > 2
    for (theta, _version), expected in zip(commits, server.after_commits, strict=True):
        np.testing.assert_allclose(theta, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("period", [1, 3])
def test_easgd_follows_algorithm_1(start_server: StartServer, period: int) -> None:
    alpha = 0.3
    server = start_server(rule="downpour", learning_rate=ETA)
    torch.manual_seed(0)
    models = [torch.nn.Linear(FEATURES, CLASSES) for _ in range(2)]
    data = [batches(w, SCHEDULE.count(w)) for w in range(2)]
    centres: list[np.ndarray] = []
    locals_after: list[np.ndarray] = []
    with RemoteModel(models[0], server.target) as first, RemoteModel(models[1], server.target) as second:
        remotes = [first, second]
        initial = first.parameters_vector().numpy().astype(np.float64)
        modes: list[TrainingMode] = [EasgdMode(remote, ETA, alpha, period) for remote in remotes]
        for w, _committed in interleave(models, modes, data):
            centres.append(remotes[w].client.pull().flat.astype(np.float64))
            locals_after.append(remotes[w].parameters_vector().numpy().astype(np.float64))

    reference_server, workers = reference(initial, data)
    taken = [0, 0]
    for i, w in enumerate(SCHEDULE):
        easgd_step(reference_server, workers[w], taken[w], alpha, period)
        taken[w] += 1
        np.testing.assert_allclose(centres[i], reference_server.theta, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(locals_after[i], workers[w].theta, rtol=1e-4, atol=1e-5)
    assert not np.allclose(reference_server.theta, initial)  # the centre moved
