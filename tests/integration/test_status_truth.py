"""Issue 43, items 5-7, on a real server: the noise scale in the workers' own batch and "no
estimate" when there is none, `gemps status` with the commit rate, training loss, held-out
figures and each worker's rate and staleness, status across replicas with the first one down,
shard indices that wrap (and say so) and slots that `Client.close()` frees."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
from gemps_cli.main import main as gemps_main

import gemps
from gemps_proto.schema import Shard
from gemps_proto.status import MIN_NOISE_WINDOWS
from tests.helpers import InProcessServer, free_port, scrape
from tests.integration.conftest import StartServer

P = 64
WINDOW = 2  # commits per noise window: MIN_NOISE_WINDOWS windows take 2 * MIN_NOISE_WINDOWS commits
WORKER_BATCH = 32  # the workers' batch; the server's --batch-size is left at its default, 64
NOISE_GAUGES = (
    "gemps_gradient_noise_scale",
    "gemps_useful_workers",
    "gemps_gradient_noise_batch_size",
    "gemps_gradient_square",
    "gemps_gradient_noise_trace",
)


def gradients(count: int, seed: int = 0) -> list[np.ndarray]:
    """A fixed gradient of 1s plus noise: |G|^2's estimate stays well above 0."""
    rng = np.random.default_rng(seed)
    return [(1.0 + rng.normal(scale=2.0, size=P)).astype(np.float32) for _ in range(count)]


def status_text(target: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert gemps_main(["status", "--server", target]) == 0
    return capsys.readouterr().out


def noise_gauges(server: InProcessServer) -> dict[str, float]:
    metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    return {name: metrics[name] for name in NOISE_GAUGES}


def test_the_noise_scale_is_in_the_workers_batch_and_says_when_the_servers_stands_in(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the gauge and status said "workers of batch 64" (the server's --batch-size) whatever
    the commits reported; the estimate is now in their num_samples, and says when they sent none."""
    server = start_server(noise_window=WINDOW)
    assert server.config.training.batch_size != WORKER_BATCH
    with gemps.Client(server.target) as client:
        client.register({"w": np.zeros(P, np.float32)})
        for gradient in gradients(WINDOW * MIN_NOISE_WINDOWS):
            client.commit(gradient, num_samples=WORKER_BATCH)
        noise = client.status().gradient_noise
        assert noise.windows == MIN_NOISE_WINDOWS and noise.batch_size == WORKER_BATCH
        assert not noise.batch_size_assumed and math.isfinite(noise.scale)
        assert noise_gauges(server)["gemps_gradient_noise_batch_size"] == WORKER_BATCH
        shown = status_text(server.target, capsys)
        assert re.search(
            rf"noise scale     ≈ \S+ samples: about \S+ workers of batch {WORKER_BATCH} pay; 1 registered", shown
        )
        for gradient in gradients(WINDOW, seed=1):  # a window of commits that report no batch
            client.commit(gradient)
        noise = client.status().gradient_noise
        assert noise.batch_size == server.config.training.batch_size and noise.batch_size_assumed
        shown = status_text(server.target, capsys)
    assert "workers of batch 64 (the server's --batch-size: commits reported no num_samples) pay" in shown


def test_no_estimate_before_enough_windows_nor_with_no_worker_registered(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's end said "about 281 workers of batch 64 pay" with 0 workers registered: now NaN
    gauges and "no estimate", also while fewer than MIN_NOISE_WINDOWS windows are measured."""
    server = start_server(noise_window=WINDOW)
    updates = gradients(WINDOW * MIN_NOISE_WINDOWS)
    with gemps.Client(server.target) as client:
        client.register({"w": np.zeros(P, np.float32)})
        for gradient in updates[:-WINDOW]:  # one window short
            client.commit(gradient, num_samples=WORKER_BATCH)
        assert client.status().gradient_noise.windows == MIN_NOISE_WINDOWS - 1
        assert all(math.isnan(value) for value in noise_gauges(server).values())
        shown = status_text(server.target, capsys)
        assert f"noise scale     no estimate ({MIN_NOISE_WINDOWS - 1} of the {MIN_NOISE_WINDOWS} windows" in shown
        assert math.isnan(client.gradient_noise().scale)
        for gradient in updates[-WINDOW:]:
            client.commit(gradient, num_samples=WORKER_BATCH)
        assert all(math.isfinite(value) for value in noise_gauges(server).values())
        last = client.gradient_noise().scale
    # The client left: no worker registered.
    assert all(math.isnan(value) for value in noise_gauges(server).values())
    shown = status_text(server.target, capsys)
    assert (
        f"noise scale     no estimate (no workers registered; the last, while workers committed: ≈ {last:.3g}" in shown
    )


def test_status_shows_the_commit_rate_training_loss_held_out_figures_and_each_workers_rate(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, `gemps status` showed no held-out figures (though Status carried them), no loss
    and no commit rate, and nothing of a worker but its ages and commit count."""
    with gemps.Client(server.target, name="busy") as client:
        client.register({"w": np.zeros(P, np.float32)})
        shown = status_text(server.target, capsys)
        assert "held-out        none reported" in shown
        assert "training loss   none reported (0 commits" in shown
        for step, gradient in enumerate(gradients(6)):
            client.commit(gradient, loss=2.0 + step, num_samples=WORKER_BATCH)  # mean loss 4.5
        client.report_evaluation(5, loss=1.25, accuracy=0.5, num_samples=100, dataset="digits")
        status = client.status()
        shown = status_text(server.target, capsys)
    recent = status.recent
    assert (recent.commits, recent.samples, recent.loss_commits, recent.loss) == (6, 6 * WORKER_BATCH, 6, 4.5)
    assert 0 < recent.seconds <= 60 and recent.rate == pytest.approx(6 / recent.seconds)
    assert re.search(r"^commit rate     \S+/s over the last [\d.]+s \(\S+ samples/s\), mean staleness 0$", shown, re.M)
    assert "training loss   4.5 (mean of 6 commits' reported loss, last " in shown
    assert "held-out        loss 1.25, accuracy 50.0% at version 5 (1 commits ago), on 100 samples of digits" in shown
    (worker,) = status.workers
    assert worker.recent.commits == 6 and worker.recent.rate > 0
    assert re.search(
        r"^  shard 0    busy .* 6 commits, \S+/s, staleness 0, π \S+ \(.*\) \(last [\d.]+s\)$", shown, re.M
    )


def test_status_with_the_first_replica_down_answers_from_the_next(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gemps status --server 'A|B'` with nothing listening at A: B answers (issue 43, item 6)."""
    down = f"127.0.0.1:{free_port()}"
    shown = status_text(f"{down}|{server.target}", capsys)
    assert f"(answered: {server.target})" in shown and "initialized     False" in shown


def test_shard_indices_wrap_and_a_shared_shard_is_said(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A fifth worker with --num-shards 4 got index 4 of 4 (no such shard): now 0, shared with
    worker 0, which the server warns of and counts, and the registration says."""
    server = start_server(num_shards=4)
    clients = [gemps.Client(server.target, name=f"w{i}") for i in range(5)]
    try:
        with caplog.at_level(logging.WARNING):
            shards = [client.register({"w": np.zeros(P, np.float32)}).shard for client in clients]
        assert shards == [Shard(0, 4), Shard(1, 4), Shard(2, 4), Shard(3, 4), Shard(0, 4, shared_with=1)]
        assert shards[4].describe() == (
            "shard 0 of 4, shared with 1 other worker: more workers than shards read the same batches"
        )
        assert [record.name for record in caplog.records if "shard shared" in record.getMessage()] == ["gemps.server"]
        said = [record.getMessage() for record in caplog.records if record.name == "gemps.client"]
        assert said == [f"{server.target}: {shards[4].describe()}"]  # the fifth worker's own log
        assert scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")["gemps_shared_shard_registrations_total"] == 1
        assert [worker.shard for worker in clients[0].status().workers] == [0, 1, 2, 3, 0]
    finally:
        for client in clients:
            client.close()


def test_without_sharding_a_worker_is_told_it_reads_all_data(server: InProcessServer) -> None:
    """Before, the reference worker logged "shard 3/0" with no sharding."""
    with gemps.Client(server.target) as client:
        shard = client.register({"w": np.zeros(P, np.float32)}).shard
    assert shard == Shard(0, 0) and shard.describe() == "all data (no sharding), in an order seeded by 0"


def test_close_frees_the_workers_shard_at_once(start_server: StartServer) -> None:
    """Before, `Client.close()` left the worker registered (and its shard taken) until its lease
    expired: the next worker got shard 1, and Status counted two workers."""
    server = start_server(num_shards=2, lease_ttl=600.0)
    first = gemps.Client(server.target)
    assert first.register({"w": np.zeros(P, np.float32)}).shard.index == 0
    first.close()
    with gemps.Client(server.target) as second:
        assert second.register({"w": np.zeros(P, np.float32)}).shard.index == 0
        assert second.status().active_workers == 1
    assert "worker left" in server.log()
