"""Chaos against real processes: the server SIGKILLed mid-training and restarted (as a supervisor
would), a worker SIGKILLed, the server paused with SIGSTOP. Training carries on by itself."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import gemps
from gemps_server.checkpoint_files import list_checkpoints
from gemps_worker.cluster import LocalCluster, ServerProcess
from tests.helpers import CommitLoops, free_port, scrape_series, stop_process, wait_for

torch = pytest.importorskip("torch")

from gemps.pytorch import load_central  # noqa: E402
from gemps_worker.datasets import load_digits  # noqa: E402
from gemps_worker.held_out import evaluate  # noqa: E402
from gemps_worker.models import build_model  # noqa: E402

# The training run: mlp on the bundled digits, equal budgets with and without faults. Big
# batches keep the gradient noise, and so the run-to-run spread of the final accuracy, small.
WORKERS = 2
EPOCHS = 60
BATCH = 256
KILLS = (0.25, 0.5, 0.75)  # fractions of the faulty run's commits at which the server dies
# Seconds a worker waits between steps, both runs: past the last kill's threshold 75 steps a worker
# are left, 3.75 s whatever the load (at full speed a loaded suite once saw them all done first).
STEP_DELAY = 0.05
SERVER_OPTIONS = {"batch_size": BATCH, "lease_ttl": 30.0}


def held_out_accuracy(target: str) -> float:
    data = load_digits()
    model = build_model("mlp", data.input_shape, data.num_classes)
    with gemps.Client(target) as observer:
        load_central(model, observer.pull())
    return evaluate(model, data.test_x, data.test_y)[1]


def metrics(server: ServerProcess) -> dict[str, float]:
    return scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")


def worker_logs(cluster: LocalCluster) -> list[str]:
    return [cluster.log(f"w{i}") for i in range(WORKERS)]


def worker_reports(cluster: LocalCluster) -> list[list[dict[str, float]]]:
    return [
        [json.loads(line) for line in (cluster.folder / f"w{i}.jsonl").read_text().splitlines()] for i in range(WORKERS)
    ]


@pytest.fixture
def clusters() -> Iterator[list[LocalCluster]]:
    made: list[LocalCluster] = []
    yield made
    for cluster in made:
        cluster.__exit__(None, None, None)


def start_run(clusters: list[LocalCluster], root: Path, name: str, **options: object) -> LocalCluster:
    """A server and its reference workers, all with the same training budget."""
    cluster = LocalCluster(root / name, server={**SERVER_OPTIONS, **options}).__enter__()
    clusters.append(cluster)
    for i in range(WORKERS):
        report = cluster.folder / f"w{i}.jsonl"
        cluster.start_worker(f"w{i}", model="mlp", seed=i, epochs=EPOCHS, report_file=report, batch_delay=STEP_DELAY)
    return cluster


def test_training_survives_three_server_kills(tmp_path: Path, clusters: list[LocalCluster]) -> None:
    steps = EPOCHS * (len(load_digits().train_x) // BATCH)  # per worker: the same budget in both runs
    checkpoints = tmp_path / "checkpoints"
    # Restarted on its port: one from the suite's band, which the kernel gives no other socket while it is down.
    faulty = start_run(clusters, tmp_path, "faulty", checkpoint_dir=checkpoints, checkpoint_every=10, port=free_port())
    clean = start_run(clusters, tmp_path, "clean")
    kills: list[tuple[float, int]] = []  # (when the restart served, newest checkpoint's version at the kill)
    for fraction in KILLS:
        threshold = int(fraction * WORKERS * steps)
        observer = gemps.Client(faulty.target, retry=gemps.RetryPolicy(max_attempts=3))
        wait_for(lambda: observer.status().version >= threshold, 240, f"version {threshold}")  # noqa: B023
        observer.close()
        port = faulty.server.port
        faulty.server.kill()  # SIGKILL: no shutdown, no final checkpoint
        newest = list_checkpoints(checkpoints)[-1][0]
        # A supervisor restarts it on the same address; the workers find it by themselves.
        faulty.start_server(port=port)
        kills.append((time.time(), newest))
        restored = re.search(r"checkpoint restored path=\S+ version=(\d+)", faulty.server.log())
        assert restored is not None and int(restored.group(1)) == newest  # never older than the newest

    for cluster in (faulty, clean):
        assert set(cluster.wait_processes(timeout=300).values()) == {0}, "\n".join(worker_logs(cluster))
    for cluster in (faulty, clean):
        for log in worker_logs(cluster):  # every worker spent its whole budget, each commit acknowledged once
            assert f"done: {steps} commits" in log, log
    assert all("registering again" in log for log in worker_logs(faulty))  # they reconnected by themselves

    # Versions never go back past the newest checkpoint at a kill: every reply from the restarted
    # server is at least that version.
    records = [record for report in worker_reports(faulty) for record in report]
    assert len(records) == WORKERS * steps
    for restarted_at, newest in kills:
        after = [record["version"] for record in records if record["time"] > restarted_at]
        assert after and min(after) >= newest, (restarted_at, newest, min(after))

    faulty_accuracy, clean_accuracy = held_out_accuracy(faulty.target), held_out_accuracy(clean.target)
    print(f"\nheld-out accuracy: {faulty_accuracy:.4f} with 3 server kills, {clean_accuracy:.4f} without")
    assert clean_accuracy > 0.9
    assert abs(faulty_accuracy - clean_accuracy) <= 0.01


def test_a_killed_worker_is_evicted_and_the_others_carry_on(tmp_path: Path, clusters: list[LocalCluster]) -> None:
    cluster = LocalCluster(tmp_path, server={"lease_ttl": 1.5}).__enter__()
    clusters.append(cluster)
    server = cluster.server
    for i in range(3):
        cluster.start_worker(f"w{i}", model="mlp", seed=i, epochs=100000)
    observer = cluster.observer()
    wait_for(lambda: observer.status().active_workers == 3 and observer.status().version >= 30, 120, "3 workers")
    parameters = observer.status().num_parameters
    cluster.processes["w0"].kill()  # SIGKILL: no Leave
    cluster.processes["w0"].wait()
    wait_for(lambda: observer.status().active_workers == 2, 30, "eviction")
    # The registry forgets it (what status reads) before the event loop logs and counts the eviction.
    wait_for(
        lambda: re.search(r"worker evicted worker_id=\w+ name=w0 ", server.log()) is not None, 10, "eviction logged"
    )
    seen = metrics(server)
    # Its GEM state is freed: 2 vectors of P floats for each of the 2 workers left.
    assert seen["gemps_rule_state_bytes"] == 2 * 2 * 4 * parameters
    assert seen['gemps_departures_total{cause="evicted"}'] == 1
    version = observer.status().version
    wait_for(lambda: observer.status().version >= version + 50, 60, "training goes on")
    for name in ("w1", "w2"):
        worker = cluster.processes[name]
        worker.send_signal(signal.SIGTERM)  # they leave cleanly
        assert worker.wait(60) == 0
    seen = metrics(server)
    assert seen["gemps_registrations_total"] == 3  # the others never had to register again
    assert seen['gemps_departures_total{cause="left"}'] == 2
    assert observer.status().active_workers == 0


def test_a_paused_server_makes_clients_time_out_retry_and_carry_on() -> None:
    with ServerProcess() as server:
        clients = [
            gemps.Client(
                server.target,
                timeout=60.0,  # the whole call: the pause is ridden out by attempts of 1 s
                attempt_timeout=1.0,
                retry=gemps.RetryPolicy(max_attempts=100, initial_backoff=0.05, max_backoff=0.5),
            )
            for _ in range(3)
        ]
        loops = CommitLoops(clients, {"w": np.zeros(1000, np.float32)}, np.full(1000, 0.01, np.float32)).start()
        loops.wait_each(10, 60, "commits before the pause")
        stop_process(server.pid)
        try:
            wait_for(lambda: all(c.retries >= 1 for c in clients) or loops.failures, 60, "every client timing out")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        loops.wait_each(10, 60, "carrying on")
        loops.stop()
        assert not loops.failures, loops.failures
        for seen in loops.versions:  # each client's view only moves forward
            assert all(a < b for a, b in itertools.pairwise(seen)), seen
        status = clients[0].status()
        # A commit whose deadline passed may still have been applied after the pause: its retry
        # got the recorded outcome, so the server applied exactly what clients saw acknowledged.
        assert status.commits_applied == sum(loops.acked)
        for client in clients:
            client.close()
