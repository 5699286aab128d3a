"""The reference worker against real servers: each mode, SIGTERM, the evaluator."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import gemps
from gemps.pytorch import RemoteModel
from gemps.stop_grace import STOP_GRACE_SECONDS
from gemps_proto.tensor_codec import INT8_BLOCK, expected_payload_nbytes
from gemps_worker.datasets import load_digits
from gemps_worker.modes import AgnMode, EasgdMode
from gemps_worker.training import StepRecord, WorkerHooks, WorkerOptions, run_worker
from tests.helpers import InProcessServer, scrape_series, stop_process, wait_for
from tests.integration.conftest import StartServer, StartServerProcess

WINDOWS = {"gradient": 30, "agn": 15, "easgd": 14}  # easgd's last window has no commit after it


# Local SGD in agn/easgd has no momentum: it gets a larger step than GEM's momentum proxy.
@pytest.mark.parametrize(
    "mode,rule,eta", [("gradient", "gem", 0.05), ("agn", "downpour", 0.3), ("easgd", "downpour", 0.3)]
)
def test_each_mode_trains_against_a_real_server(mode: str, rule: str, eta: float, start_server: StartServer) -> None:
    server = start_server(rule=rule, learning_rate=eta)
    records: list[StepRecord] = []
    options = WorkerOptions(
        server=server.target, model="mlp", mode=mode, epochs=20, max_steps=60, agn_steps=2, easgd_period=2
    )
    summary = run_worker(options, hooks=WorkerHooks(on_step=records.append))
    assert summary.steps == 60 and not summary.diverged
    assert [r.version for r in records] == list(range(1, 61))  # one worker: every commit is its own
    first, last = np.mean([r.loss for r in records[:10]]), np.mean([r.loss for r in records[-10:]])
    assert last < 0.7 * first, (first, last)
    with gemps.Client(server.target) as client:
        status = client.status()
    assert status.active_workers == 0  # left cleanly
    # The noise scale's windows: the server's own of 2 gradient commits, else the worker's of 8
    # local steps (120 here), whose sums its update commits carry (issue 78: before, none).
    assert status.gradient_noise.windows == WINDOWS[mode], status.gradient_noise


def test_a_worker_with_compressed_commits_and_replies_trains_and_moves_the_codes(start_server: StartServer) -> None:
    """`--compression int8 --reply-compression int8`: the server receives and sends int8 codes (the
    first reply θ whole in bfloat16), and the worker still trains from the copies its replies leave."""
    server = start_server(rule="gem", learning_rate=0.05)
    records: list[StepRecord] = []
    options = WorkerOptions(
        server=server.target, model="mlp", epochs=20, max_steps=60, compression="int8", reply_compression="int8"
    )
    summary = run_worker(options, hooks=WorkerHooks(on_step=records.append))
    assert summary.steps == 60 and not summary.diverged
    first, last = np.mean([r.loss for r in records[:10]]), np.mean([r.loss for r in records[-10:]])
    assert last < 0.7 * first, (first, last)
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    wire = 'gemps_wire_bytes_total{{direction="{}",encoding="{}"}}'
    size = server.server.state.core.num_parameters
    assert series[wire.format("received", "int8")] == 60 * expected_payload_nbytes(INT8_BLOCK, [size])
    assert series[wire.format("sent", "int8")] == 59 * expected_payload_nbytes(INT8_BLOCK, [size])
    assert series[wire.format("sent", "bfloat16")] == 2 * size


def tiny_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize(("outer", "factor"), [(0.0, 1 / 3), (0.5, 0.5)])
def test_agn_commits_the_accumulated_update_over_lambda_or_times_an_outer_learning_rate(
    start_server: StartServer, outer: float, factor: float
) -> None:
    """AGN's (θλ - θ0) / λ, or with --outer-learning-rate, (θλ - θ0) x it (GEM with local steps)."""
    server = start_server(rule="downpour", learning_rate=0.1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with RemoteModel(model, server.target) as remote:
        start = remote.parameters_vector()
        mode = AgnMode(remote, learning_rate=0.1, local_steps=3, outer=outer)
        assert mode.on_batch(lambda: tiny_step(model, x, y), 8) is None
        assert mode.on_batch(lambda: tiny_step(model, x, y), 8) is None
        local_before_third = remote.parameters_vector()
        committed = mode.on_batch(lambda: tiny_step(model, x, y), 8)
        assert committed is not None
        # Replay the third local step to know where the local variable ended.
        check = torch.nn.Linear(4, 3)
        torch.nn.utils.vector_to_parameters(local_before_third, check.parameters())
        tiny_step(check, x, y).backward()
        grads = [p.grad for p in check.parameters()]
        assert all(g is not None for g in grads)
        local_end = local_before_third - 0.1 * torch.cat([g.reshape(-1) for g in grads if g is not None])
        expected = start + (local_end - start) * factor
        np.testing.assert_allclose(committed.result.parameters.flat, expected.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(remote.parameters_vector().numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_local_steps_with_momentum_keep_a_velocity_with_the_servers_mu(start_server: StartServer) -> None:
    """--local-optimizer momentum: v <- mu v + g, x <- x - eta v, mu the server's (0.5 here): its
    rule's momentum option. Rule momentum, whose first commit (from a velocity of 0) adds the
    update as sent, as downpour would (downpour takes no mu)."""
    server = start_server(rule="momentum", learning_rate=0.1, momentum=0.5)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with RemoteModel(model, server.target) as remote:
        check = torch.nn.Linear(4, 3)
        torch.nn.utils.vector_to_parameters(remote.parameters_vector(), check.parameters())
        velocity = torch.zeros_like(remote.parameters_vector())
        for _ in range(2):  # the same two steps, replayed by hand
            check.zero_grad()
            tiny_step(check, x, y).backward()
            gradient = torch.cat([p.grad.reshape(-1) for p in check.parameters() if p.grad is not None])
            velocity = 0.5 * velocity + gradient
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(
                    torch.nn.utils.parameters_to_vector(check.parameters()) - 0.1 * velocity, check.parameters()
                )
        mode = AgnMode(remote, learning_rate=0.1, local_steps=2, optimizer="momentum", outer=1.0)
        assert mode.on_batch(lambda: tiny_step(model, x, y), 8) is None
        committed = mode.on_batch(lambda: tiny_step(model, x, y), 8)
        assert committed is not None
        expected = torch.nn.utils.parameters_to_vector(check.parameters()).detach().numpy()
        np.testing.assert_allclose(committed.result.parameters.flat, expected, rtol=1e-5, atol=1e-6)


def test_local_steps_with_momentum_are_refused_where_the_rule_has_no_mu(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    refusal = "local optimizer 'momentum' takes the server's mu, and rule 'downpour' has none"
    with RemoteModel(torch.nn.Linear(4, 3), server.target) as remote, pytest.raises(ValueError, match=refusal):
        AgnMode(remote, learning_rate=0.1, local_steps=2, optimizer="momentum")


def test_easgd_moves_center_and_local_variable_elastically(start_server: StartServer) -> None:
    """Algorithm 1 of Zhang et al.: at each communication, e = alpha (x - centre), the centre
    moves by +e and the local variable by -e (then its SGD step, the gradient taken at x)."""
    server = start_server(rule="downpour")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with RemoteModel(model, server.target) as remote:
        center_before = remote.parameters_vector()
        mode = EasgdMode(remote, learning_rate=0.5, alpha=0.25, period=1)
        first = mode.on_batch(lambda: tiny_step(model, x, y), 8)
        assert first is not None  # t = 0: x is the centre, so e = 0 and the centre stays
        torch.testing.assert_close(torch.from_numpy(first.result.parameters.flat.copy()), center_before)
        x_local = remote.parameters_vector()  # moved by its SGD step alone
        assert float((x_local - center_before).abs().sum()) > 0
        committed = mode.on_batch(lambda: tiny_step(model, x, y), 8)
        assert committed is not None
        center_after = torch.from_numpy(committed.result.parameters.flat.copy())
        elastic = center_after - center_before
        torch.testing.assert_close(elastic, 0.25 * (x_local - center_before), rtol=1e-5, atol=1e-6)
        assert float(elastic.abs().sum()) > 0


def test_sigterm_makes_the_worker_leave_cleanly(server: InProcessServer) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-m", "gemps_cli", "worker", "--server", server.target, "--epochs", "1000", "--name", "w"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    observer = gemps.Client(server.target)
    try:
        wait_for(lambda: observer.status().version >= 5, timeout=60.0)
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=30)
    finally:
        worker.kill()
    assert worker.returncode == 0, output
    assert "stopped by signal" in output
    assert observer.status().active_workers == 0
    assert "worker left" in server.log()  # a clean Leave, not an eviction
    observer.close()


def evaluate_once(server: InProcessServer, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gemps_cli", "evaluate", "--server", server.target, "--max-evaluations", "1"]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=120)


def test_evaluator_reports_held_out_figures(server: InProcessServer) -> None:
    run_worker(WorkerOptions(server=server.target, model="mlp", epochs=3, max_steps=40))
    result = evaluate_once(server, "--model", "mlp", "--interval", "0.1")
    assert result.returncode == 0, result.stderr
    with gemps.Client(server.target) as client:
        evaluation = client.status().last_evaluation
    assert evaluation is not None and evaluation.version == 40
    assert evaluation.accuracy > 0.5 and evaluation.num_samples == len(load_digits().test_x)
    assert "held-out loss" in result.stderr


def test_evaluator_refuses_a_model_that_does_not_fit(server: InProcessServer) -> None:
    run_worker(WorkerOptions(server=server.target, max_steps=1))  # digits-cnn
    result = evaluate_once(server, "--model", "mlp")
    assert result.returncode == 1
    assert "do not fit model 'mlp'" in result.stderr


def test_sigterm_stops_a_worker_waiting_for_an_unreachable_server() -> None:
    # A port bound and never listened on: connections to it are refused, and while it is held no
    # other test's server can be given it (a stopped server's port once was, in CI: the worker
    # found that server, trained and ended without ever retrying).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        worker = subprocess.Popen(
            [sys.executable, "-m", "gemps_cli", "worker", "--server", f"127.0.0.1:{port}", "--name", "w"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert worker.stdout is not None
        before: list[str] = []
        try:
            for line in worker.stdout:  # the first retry is logged: now it is waiting to retry
                before.append(line)
                if "retrying in" in line:
                    break
            else:
                pytest.fail("the worker ended without retrying:\n" + "".join(before))
            worker.send_signal(signal.SIGTERM)
            output, _ = worker.communicate(timeout=15)  # well before its retries would run out
        finally:
            worker.kill()
    assert worker.returncode == 0, output
    assert "stopped while retrying" in output and "stopped by signal" in output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_worker_whose_server_hangs_within_the_grace(
    start_server_process: StartServerProcess, signum: signal.Signals
) -> None:
    """The signal lets the step finish; against a server that hangs (SIGSTOPped: connections open,
    nothing answered) the step's commit waited for its attempt's timeout, 60 s: a user's Ctrl-C took
    a minute. The client given the stop ends a call still in flight STOP_GRACE_SECONDS after it was
    set, and the worker leaves (one short attempt) and ends as stopped."""
    server = start_server_process()
    argv = [sys.executable, "-m", "gemps_cli", "worker", "--server", server.target, "--epochs", "1000", "--name", "w"]
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with gemps.Client(server.target) as observer:
            wait_for(lambda: observer.status().version >= 5, timeout=60.0)
        stop_process(server.pid)
        time.sleep(1.0)  # the worker's commit is waiting on the stopped server now
        signalled = time.monotonic()
        worker.send_signal(signum)
        output, _ = worker.communicate(timeout=STOP_GRACE_SECONDS + 25)  # before: the commit's 60-s attempt
        took = time.monotonic() - signalled
    finally:
        os.kill(server.pid, signal.SIGCONT)
        worker.kill()
    assert worker.returncode == 0, output
    assert "stopped by signal" in output and "ending the call in flight" in output, output
    assert took >= STOP_GRACE_SECONDS - 1, (took, output)  # the step was given its grace


def test_max_seconds_ends_training_after_that_long_whatever_the_epochs(start_server: StartServer) -> None:
    """The container tutorial's workers train for a set time (GEMPS_MAX_SECONDS), not for epochs
    whose length depends on the machine (issue 60, item 5: 5 epochs ended 40 s after `up`)."""
    server = start_server(rule="gem", learning_rate=0.05)
    began = time.monotonic()
    summary = run_worker(WorkerOptions(server=server.target, model="mlp", epochs=100_000, max_seconds=3.0))
    took = time.monotonic() - began
    assert summary.steps > 0 and not summary.stopped_early and 3.0 <= took < 20, (summary, took)
    with pytest.raises(ValueError, match=r"max_seconds -1\.0 is outside \[0, 2147483\.647\] seconds"):
        run_worker(WorkerOptions(server=server.target, model="mlp", max_seconds=-1.0))
