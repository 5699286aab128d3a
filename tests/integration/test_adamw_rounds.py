"""The adamw rule through a real server and the SDK (issue 78): workers that commit gradients get
θ back once their round closed, so N workers train as DDP-AdamW does at a global batch of N x b;
with a backup worker, no round waits for the slowest, whose late gradients are dropped."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import torch

import gemps
from gemps.pytorch import LocalSteps
from gemps.records import CommitResult
from tests.integration.commit_threads import run_together
from tests.integration.conftest import StartServer

P = 64
SHAPE = (8, 8)  # P values
WORKERS = 4
ROUNDS = 12
LEARNING_RATE = 0.05


def gradient_of(worker: int) -> Callable[[np.ndarray], np.ndarray]:
    """A worker's gradient at θ: of its own quadratic, so it depends on the θ it was taken on."""
    rng = np.random.default_rng(worker)
    scale, centre = rng.uniform(0.5, 2.0, P).astype(np.float32), rng.normal(size=P).astype(np.float32)
    return lambda theta: (scale * (theta - centre)).astype(np.float32)


def train(
    target: str, plane: str, worker: int, rounds: int, ready: threading.Barrier, delay: float = 0.0
) -> list[CommitResult]:
    gradient = gradient_of(worker)
    results = []
    with gemps.Client(target, name=f"w{worker}", plane=plane) as client:
        client.register({"theta": np.zeros(SHAPE, np.float32)})  # a matrix: the rule's decay applies to it
        ready.wait(timeout=60)  # every worker registered: a round is all four
        central = client.pull()
        for _ in range(rounds):
            time.sleep(delay)
            results.append(client.commit(gradient(np.asarray(central.flat)), num_samples=1))
            central = results[-1].parameters
        client.leave()
    return results


def run_workers(target: str, plane: str, delays: list[float], rounds: list[int]) -> list[list[CommitResult]]:
    ready = threading.Barrier(len(delays))
    results: list[list[CommitResult]] = [[] for _ in delays]

    def work(worker: int) -> None:
        results[worker] = train(target, plane, worker, rounds[worker], ready, delays[worker])

    run_together([partial(work, worker) for worker in range(len(delays))])
    return results


@pytest.mark.parametrize("plane", ["grpc", "data"])
def test_four_workers_take_ddp_adamws_steps_on_the_mean_of_each_rounds_gradients(
    start_server: StartServer, plane: str
) -> None:
    server = start_server(rule="adamw", learning_rate=LEARNING_RATE, adam_weight_decay=0.1)
    results = run_workers(server.target, plane, [0.0] * WORKERS, [ROUNDS] * WORKERS)

    # Every commit joined a round on that round's θ (none dropped), and got θ after the round:
    # the one that closed it at once, the others once θ moved.
    for result in (result for each in results for result in each):
        assert result.scaling_mean == pytest.approx(1 / WORKERS), result
        assert result.round_pending == 0 or result.parameters.version > result.version, result
    assert sum(result.round_pending == 0 for each in results for result in each) == ROUNDS
    # DDP-AdamW: each step on the mean of the four workers' gradients at the same θ.
    theta = torch.zeros(P, requires_grad=True)
    optimizer = torch.optim.AdamW([theta], lr=LEARNING_RATE, weight_decay=0.1)
    for _ in range(ROUNDS):
        at = theta.detach().numpy()
        theta.grad = torch.from_numpy(np.mean([gradient_of(worker)(at) for worker in range(WORKERS)], axis=0))
        optimizer.step()
    with gemps.Client(server.target) as observer:
        central = observer.pull()
    assert central.version == WORKERS * ROUNDS
    np.testing.assert_allclose(np.asarray(central.flat), theta.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_with_a_backup_worker_the_rounds_go_at_the_fast_workers_pace(start_server: StartServer) -> None:
    server = start_server(rule="adamw", learning_rate=LEARNING_RATE, backup_workers=1)
    # Three that take 10 ms a gradient (200 each), one that takes 0.5 s (4); a round: the first three.
    results = run_workers(server.target, "grpc", [0.01, 0.01, 0.01, 0.5], [200, 200, 200, 4])
    slow = results[3]
    # Rounds went on while the slow worker computed, so its gradients came in on a θ they had
    # moved since (three commits a round), and were dropped.
    assert all(result.staleness >= 9 and result.scaling_at_zero == 1.0 for result in slow), [
        (result.staleness, result.scaling_mean) for result in slow
    ]
    # While it was there, every fast worker's gradient joined a round, one of three (once it left,
    # a round is two of the three: the one backup is then a fast worker).
    joined = [result.scaling_mean for each in results[:3] for result in each if result.version < slow[-1].version]
    assert len(joined) >= 9 and all(share == pytest.approx(1 / 3) for share in joined), sorted(set(joined))


def test_a_round_slower_than_the_clients_timeout_is_waited_for_not_failed(start_server: StartServer) -> None:
    """The round's wait is no part of the commit's deadline: each of its pulls has its own."""
    server = start_server(rule="adamw", learning_rate=LEARNING_RATE)
    gradient = gradient_of(0)
    with gemps.Client(server.target, name="quick", timeout=1.0) as quick, gemps.Client(server.target) as slow:
        for client in (quick, slow):
            client.register({"theta": np.zeros(P, np.float32)})
        late = threading.Timer(2.5, lambda: slow.commit(gradient(np.zeros(P, np.float32))))
        late.start()
        started = time.monotonic()
        result = quick.commit(gradient(np.zeros(P, np.float32)))  # its round closes with the slow one's, 2.5 s on
        late.join()
        assert result.round_pending == 1 and result.parameters.version == 2
        assert time.monotonic() - started >= 2.0
        np.testing.assert_array_equal(np.asarray(result.parameters.flat), np.asarray(quick.pull().flat))


def test_with_an_outer_rate_rounds_of_updates_are_averaged_and_a_gradient_refused(start_server: StartServer) -> None:
    """Local AdamW through the server (`--outer-rate 1`): each round of the workers' window updates
    moves θ by their mean; a gradient, which that would average as if it were an update, is refused."""
    server = start_server(rule="adamw", learning_rate=LEARNING_RATE, outer_rate=1.0)
    deltas = [np.random.default_rng(worker).normal(size=P).astype(np.float32) for worker in range(2)]
    with gemps.Client(server.target, name="w0") as first, gemps.Client(server.target, name="w1") as second:
        for client in (first, second):
            client.register({"theta": np.ones(SHAPE, np.float32)})
        with pytest.raises(gemps.FailedPreconditionError, match="a gradient, where adamw with outer_rate 1"):
            first.commit(deltas[0])
        assert first.pull().version == 0  # refused: nothing changed
        waiting = threading.Thread(target=lambda: first.commit(deltas[0], kind="update"))
        waiting.start()  # its round needs the second's update too
        second.commit(deltas[1], kind="update")
        waiting.join(timeout=60)
        central = second.pull()
    assert central.version == 2
    np.testing.assert_allclose(np.asarray(central.flat), 1 + (deltas[0] + deltas[1]) / 2, rtol=1e-6)


@pytest.mark.parametrize("codes", [None, "int8"])
def test_local_steps_under_rounds_start_each_window_at_the_rounds_theta(
    start_server: StartServer, codes: str | None
) -> None:
    """LocalSteps' look-ahead (on by default) extrapolates θ's move past a reply; under rounds θ does
    not move while a round is open, so every window starts at θ as the round left it. With int8
    codes both ways (the slow-link setting) the θ a worker holds stays the server's, to the codes'
    precision: the round's θ comes by a pull, not by the commit's reply."""
    server = start_server(rule="adamw", outer_rate=1.0)
    ready, models, failures = threading.Barrier(2), [torch.nn.Linear(4, 2) for _ in range(2)], []
    held: list[np.ndarray] = [np.empty(0), np.empty(0)]
    with torch.no_grad():
        models[1].load_state_dict(models[0].state_dict())

    def work(worker: int) -> None:
        model = models[worker]
        adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
        with LocalSteps(model, adamw, server.target, steps=2, compression=codes, reply_compression=codes) as optimizer:
            ready.wait(timeout=60)  # both registered: a round is both windows
            for step in range(12):
                optimizer.zero_grad()
                model(torch.full((3, 4), float(worker + step))).square().mean().backward()
                optimizer.step()
                result = optimizer.last_result
                if step % 2 and result is not None:  # committed: the model holds the window's start
                    held[worker] = optimizer.remote.parameters_vector().numpy()
                    if not np.array_equal(held[worker], result.parameters.flat):
                        failures.append(
                            f"worker {worker}, window {step // 2}: off θ by {held[worker] - result.parameters.flat}"
                        )

    run_together([partial(work, worker) for worker in range(2)])
    assert not failures, failures
    with gemps.Client(server.target) as observer:
        central = observer.pull()
    assert central.version == 12  # 6 windows each, 6 rounds
    for theta in held:  # the last round's θ, as each worker holds it
        np.testing.assert_allclose(theta, central.flat, atol=0 if codes is None else 1e-2 * np.abs(central.flat).max())


def test_local_steps_under_rounds_of_windows_set_adamws_momentum_from_the_rounds_move(
    start_server: StartServer,
) -> None:
    """With `round_momentum=True` under `--outer-rate`, after each round a worker's AdamW first
    moment is what, with its own second moment, steps θ along the round's move
    (gemps.pytorch.round_momentum): the reply less the window's start. On by default where it
    applies, off where it does not; asked for there, it is refused, naming why. β2 0.5: v averages
    1/(1 - β2) = 2 steps by the first round's close, from which the moments are set."""
    server = start_server(rule="adamw", outer_rate=1.0)
    model = torch.nn.Linear(4, 2)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.5), weight_decay=0.1)
    with LocalSteps(model, adamw, server.target, steps=2, round_momentum=True) as optimizer:
        assert optimizer.round_momentum
        for window in range(3):
            start = optimizer.remote.parameters_vector().clone()
            for step in range(2):
                optimizer.zero_grad()
                model(torch.full((3, 4), float(window + step))).square().mean().backward()
                optimizer.step()
            end = optimizer.remote.parameters_vector()
            assert not torch.equal(start, end)
            at = 0
            for p in model.parameters():  # AdamW's next step, from the moments as set: the move per step
                state, size = adamw.state[p], p.numel()
                t, (beta1, beta2) = float(state["step"]), adamw.param_groups[0]["betas"]
                root = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt() + adamw.param_groups[0]["eps"]
                theta = start[at : at + size].view_as(p)
                step = -0.01 * (state["exp_avg"] / (1 - beta1**t) / root + 0.1 * theta)
                torch.testing.assert_close(step, (end - start)[at : at + size].view_as(p) / 2, rtol=1e-4, atol=1e-8)
                at += size

    def fresh(kind: type[torch.optim.SGD | torch.optim.AdamW]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        other = torch.nn.Linear(4, 2)
        return other, kind(other.parameters(), lr=0.01)

    with LocalSteps(*fresh(torch.optim.AdamW), server.target) as other:
        assert other.round_momentum  # on by default where it applies ...
    with LocalSteps(*fresh(torch.optim.AdamW), server.target, round_momentum=False) as other:
        assert not other.round_momentum  # ... unless turned off
    with LocalSteps(*fresh(torch.optim.SGD), server.target) as other:
        assert not other.round_momentum  # ... and off, unasked, where it does not
    with pytest.raises(ValueError, match=r"round_momentum=True: .*not of SGD"):
        LocalSteps(*fresh(torch.optim.SGD), server.target, round_momentum=True)
    downpour = start_server(rule="downpour")
    with LocalSteps(*fresh(torch.optim.AdamW), downpour.target) as other:
        assert not other.round_momentum
    with pytest.raises(ValueError, match=r"round_momentum=True: the server's rule downpour .*--outer-rate"):
        LocalSteps(*fresh(torch.optim.AdamW), downpour.target, round_momentum=True)
    with pytest.raises(TypeError, match=r"round_momentum must be True, False or None"):
        LocalSteps(*fresh(torch.optim.AdamW), server.target, round_momentum="yes")  # type: ignore[arg-type]
