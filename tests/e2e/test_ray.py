"""gemps on a real multi-node Ray cluster built here: `ray.cluster_utils.Cluster` starts a head and
two more nodes, each its own raylet with its own resources, so where actors land is Ray's real
scheduling. Three jobs: the Ray guide's `gemps ray` command (docs/guides/ray.md) end to end (partitions on distinct
nodes, the demo's accuracy bar, the export against the servers' final checkpoints), worker and
partition actors killed mid-run (the chaos tests' invariants), and `ray.cancel` of the task
running a job (everything ends cleanly).

CI cost: one cluster for the module, about 10 s to start; the three jobs take about 30-60 s each
on 2 shared cores (docs/RAY.md states the measured total).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Every node's address as Ray gives it to actors (and so where the partitions listen) is then
# loopback: gemps traffic in these tests stays on 127.0.0.1. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import safetensors.numpy  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import gemps  # noqa: E402
from gemps.retry import RetryPolicy  # noqa: E402
from gemps_server.checkpoint_files import assemble_partitions, load_latest  # noqa: E402
from gemps_worker.on_ray import RayJob, RayJobOptions, WorkerContext, run_job  # noqa: E402
from gemps_worker.on_ray.actors import STATE_FILE  # noqa: E402
from gemps_worker.on_ray.local import LOOPBACK, local_cluster  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

RAY_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "ray.md"  # the README's Ray section, moved
NODES = 3
CPUS_PER_NODE = 1
# Small slices of each node's one CPU, so a job's actors fit beside each other on 3 CPUs.
SLICE = 0.25
SMALL_FLAGS = [arg for name in ("partition", "worker", "evaluator") for arg in (f"--{name}-cpus", str(SLICE))]
DEMO_BAR = 0.90  # tests/e2e/test_demo.py's held-out accuracy bar
STEPS_PER_EPOCH = 1437 // 64  # digits' training set in batches of the default 64


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(NODES, CPUS_PER_NODE) as made:
        yield made


def small_job(folder: Path, **options: Any) -> RayJobOptions:
    """2 partitions, 2 workers of a user's function, in slices of the nodes' CPUs."""
    return RayJobOptions(
        partitions=2, workers=2, evaluate=False, interval=0.5, work_dir=str(folder / "work"), out=str(folder / "out"),
        partition_cpus=SLICE, worker_cpus=SLICE, evaluator_cpus=SLICE, **options,
    )  # fmt: skip


def node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


def readme_command() -> list[str]:
    """The `gemps ray ...` line of the Ray guide ("On a Ray cluster", once the README's section), as
    argv after `gemps`."""
    section = RAY_GUIDE.read_text().split("# On a Ray cluster", 1)[1]
    line = next(line for line in section.splitlines() if line.startswith("gemps ray "))
    return shlex.split(line.split("#", 1)[0])[1:]


def final_checkpoints(work: Path) -> tuple[int, dict[str, np.ndarray]]:
    """θ as the partitions' final checkpoints hold it (partition 0's version)."""
    found = [load_latest(folder) for folder in sorted(work.glob("partition-*"))]
    checkpoints = [checkpoint for _, checkpoint in filter(None, found)]
    return checkpoints[0].version, assemble_partitions(checkpoints)


# The guide's command as written (8 workers, 4 epochs): 105-220 s beside two more test runners
# here, past 300 once in CI; its own subprocess timeout is what bounds it.
@pytest.mark.timeout(660)
def test_the_readme_command_trains_across_nodes(cluster: Cluster, tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [*readme_command(), "--address", cluster.address, "--out", str(out), "--work-dir", str(work), *SMALL_FLAGS]
    assert argv[:6] == ["ray", "--partitions", "2", "--workers", "8", "--epochs"], argv
    result = subprocess.run([sys.executable, "-m", "gemps_cli", *argv], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())

    # Two partitions, each on its own Ray node of this cluster.
    placed = [partition["node_id"] for partition in summary["partitions"]]
    assert len(set(placed)) == 2 and set(placed) <= node_ids() and len(summary["nodes"]) == NODES, summary
    # Every worker spent its budget; partition 0 applied each commit once.
    epochs = int(argv[argv.index("--epochs") + 1])
    workers = summary["workers"]
    assert [w["commits"] for w in workers] == [epochs * STEPS_PER_EPOCH] * 8, workers
    assert summary["export"]["version"] == 8 * epochs * STEPS_PER_EPOCH
    assert len({w["node_id"] for w in workers}) > 1  # SPREAD: not all on one node
    # The demo's bar, measured by the evaluator actor on the final θ.
    assert summary["final"]["accuracy"] >= DEMO_BAR, result.stdout
    assert "held-out accuracy" in result.stdout and "commits/s" in result.stdout
    # The noise scale over both partitions, in the progress lines and the summary.
    assert " pay)" in result.stdout and "\nnoise scale" in result.stdout, result.stdout
    assert summary["samples"][-1]["gradient_noise"]["windows"] > 0

    # The export collected to the driver is the servers' θ: their final checkpoints, assembled.
    version, theta = final_checkpoints(work)
    exported = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert version == summary["export"]["version"]
    assert exported.keys() == theta.keys()
    for name, value in theta.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)

    # A Prometheus file-SD list: both partitions, every worker, the evaluator, by the dashboards' job names.
    groups = json.loads((out / "prometheus-targets.json").read_text())
    jobs = sorted(group["labels"]["job"] for group in groups)
    assert jobs == ["gemps-evaluator"] + ["gemps-server"] * 2 + ["gemps-worker"] * 8, groups
    for group in groups:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", group["targets"][0]), group


# -- faults ------------------------------------------------------------------------------------

SIZE = 3001  # θ of a counting model: with downpour and updates of ones, θ counts applied commits
ONES = np.ones(SIZE, np.float32)


def count_commits(folder: str, context: WorkerContext) -> int:
    """A user's training function: commit updates of ones until stopped, appending the versions of
    each acknowledged commit (one per partition) to this worker's file as the reply arrives."""
    retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.5)
    commits = 0
    path = Path(folder) / f"worker-{context.index}.jsonl"
    with (
        gemps.Client(context.server, stop=context.stop, timeout=120.0, attempt_timeout=10.0, retry=retry) as client,
        path.open("a", buffering=1) as acks,
    ):
        client.register({"w": np.zeros(SIZE, np.float32)})
        while not context.stop.is_set():
            result = client.commit(ONES, kind="update")
            acks.write(json.dumps(result.parameters.versions) + "\n")
            commits += 1
    return commits


def acknowledged(folder: Path) -> list[list[list[int]]]:
    """Per worker, the partitions' versions of each acknowledged commit, in order."""
    return [
        [json.loads(line) for line in path.read_text().splitlines()] for path in sorted(folder.glob("worker-*.jsonl"))
    ]


def acks_of(folder: Path, worker: int) -> int:
    path = folder / f"worker-{worker}.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def scrape(target: str) -> str:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def partition_state(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / STATE_FILE).read_text()))


def listen_when_free(host: str, port: int, *, within: float) -> socket.socket:
    """Listen on host:port as soon as its holder lets go of it, as a process binding a free port."""
    deadline = time.monotonic() + within
    while True:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError:
            listener.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
            continue
        listener.listen()
        return listener


def test_killed_worker_and_partition_actors_come_back_and_no_commit_is_applied_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Ray restarts a killed worker actor (it registers again and carries on) and a killed partition
    actor (its server again on the same node and port, from its newest checkpoint, and on a fresh
    metrics port since another process took the old one; the workers retry and carry on). The
    invariants of the chaos tests: the partition left alone applied every acknowledged commit
    exactly once; each partition's θ counts its own applied commits (none applied twice); the
    restarted partition resumed from its newest checkpoint, never older."""
    acks = tmp_path / "acks"
    acks.mkdir()
    options = small_job(tmp_path, checkpoint_every=1)
    train = functools.partial(count_commits, str(acks))
    with RayJob(options, train=train, server_options={"rule": "downpour", "lease_ttl": 600.0}) as job:
        assert len(set(job.partition_nodes())) == 2
        for worker in range(2):
            wait_for(lambda w=worker: acks_of(acks, w) >= 30, 180, f"worker {worker} committing")  # type: ignore[misc]
        # Every metrics endpoint in the Prometheus list answers, each partition's under its label.
        groups = json.loads((tmp_path / "out" / "prometheus-targets.json").read_text())
        for group in groups:
            assert f'partition="{group["labels"]["partition"]}"' in scrape(group["targets"][0])

        # Kill worker 0's actor: Ray restarts it and its training function runs again.
        first = job.partitions[0]
        ray.kill(job.worker_actors[0], no_restart=False)
        log0 = Path(first.folder) / "server.log"
        wait_for(lambda: log0.read_text().count("worker joined") == 3, 180, "worker 0 registering again")
        before = acks_of(acks, 0)
        wait_for(lambda: acks_of(acks, 0) >= before + 30, 180, "the restarted worker committing")

        # Kill partition 1's actor: its server dies with it (SIGKILL: no final checkpoint).
        second = job.partitions[1]
        folder1 = Path(second.folder)
        acked_before = [acks_of(acks, w) for w in range(2)]
        ray.kill(job.partition_actors[1], no_restart=False)
        # Another process takes its metrics port as a free one while it is down (it happened: a Ray
        # worker of another job): the restart must serve on a fresh one, not wait for it forever.
        squatter = listen_when_free(second.host, second.metrics_port, within=60.0)
        wait_for(lambda: partition_state(folder1)["starts"] == 2, 180, "partition 1 restarted")

        def new_endpoint() -> bool:
            job.refresh()
            return job.partitions[1].starts == 2

        wait_for(new_endpoint, 60, "partition 1's new endpoint")
        restarted = job.partitions[1]
        assert (restarted.node_id, restarted.port) == (second.node_id, second.port)  # its bundle's node, its port
        assert restarted.metrics_port not in (second.metrics_port, -1)  # a fresh one: the old one is held
        squatter.close()
        targets = tmp_path / "out" / "prometheus-targets.json"
        wait_for(
            lambda: f"{second.host}:{restarted.metrics_port}" in targets.read_text(),
            60,
            "the new metrics port in the Prometheus targets",
        )
        assert 'partition="1"' in scrape(f"{second.host}:{restarted.metrics_port}")
        assert restarted.pid != second.pid
        # The driver saw its new life: its process died, not its node.
        partition_restarts = [r for r in job.faults.restarts if r.actor == "partition 1"]
        assert [(r.node_id, r.node_lost) for r in partition_restarts] == [(second.node_id, False)], job.faults.restarts
        for worker in range(2):
            wait_for(
                lambda w=worker: acks_of(acks, w) >= acked_before[w] + 30,  # type: ignore[misc]
                180,
                f"worker {worker} carrying on",
            )
        job.stop_workers()  # they leave cleanly
        with gemps.Client(job.target, timeout=30.0) as observer:
            statuses = observer.statuses()
            theta = observer.pull().flat
    records = acknowledged(acks)
    total = sum(map(len, records))
    applied = [status.commits_applied for status in statuses]
    versions = [status.version for status in statuses]
    restored = re.search(r"checkpoint restored path=\S+ version=(\d+)", (folder1 / "server.log").read_text())
    assert restored is not None
    restored_version = int(restored.group(1))
    last_acked = max(record[1] for w, worker in enumerate(records) for record in worker[: acked_before[w]])
    print(
        f"\nacknowledged {total}, applied {applied}; partition 1 restored at version {restored_version}, "
        f"had acknowledged {last_acked} when the kill was decided"
    )

    boundary = SIZE // 2 + 1  # partition_bounds(SIZE, 2): the first range one element longer
    # Partition 0, never killed: every acknowledged commit applied, once; at most the one commit
    # in flight when worker 0 died applied without an acknowledgement.
    assert total <= applied[0] <= total + 1
    np.testing.assert_array_equal(theta[:boundary], np.full(boundary, versions[0], np.float32))
    # Partition 1: θ counts its commits (none applied twice, restore included), and it resumed from
    # a checkpoint no older than what it had acknowledged long before the kill.
    np.testing.assert_array_equal(theta[boundary:], np.full(SIZE - boundary, versions[1], np.float32))
    assert versions[1] <= applied[0]
    # The newest checkpoint at the kill held every commit acknowledged well before it (checkpoint
    # every commit: it lags by the commits in flight while one is written, never by half the run).
    earlier = max(record[1] for w, worker in enumerate(records) for record in worker[: acked_before[w] // 2])
    assert restored_version >= earlier
    # Each worker's view only moves forward: partition 0's versions strictly increase; partition 1's
    # too, but for one step back at its restore, never below its checkpoint.
    for seen in records:
        assert all(a[0] < b[0] for a, b in itertools.pairwise(seen))
        drops = [b[1] for a, b in itertools.pairwise(seen) if b[1] <= a[1]]
        assert len(drops) <= 1 and all(version > restored_version for version in drops), drops


# -- cancel ------------------------------------------------------------------------------------


def train_with_remote_optimizer(context: WorkerContext) -> int:
    """A user's PyTorch loop, the SDK unchanged: RemoteOptimizer in place of torch.optim.SGD."""
    import torch.nn.functional as F

    from gemps.pytorch import RemoteOptimizer
    from gemps_worker.datasets import load_digits

    data = load_digits()
    inputs, targets = torch.from_numpy(data.train_x).flatten(1), torch.from_numpy(data.train_y)
    model = torch.nn.Linear(inputs.shape[1], data.num_classes)
    optimizer = RemoteOptimizer(model, gemps.Client(context.target, stop=context.stop))  # as the Ray guide's
    generator = torch.Generator().manual_seed(context.index)
    steps = 0
    try:
        while not context.stop.is_set():
            batch = torch.randint(len(inputs), (64,), generator=generator)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs[batch]), targets[batch]).backward()
            optimizer.step()
            steps += 1
    finally:
        optimizer.close()  # leave the server
    return steps


def partition_zero_port(work: Path) -> int | None:
    state = work / "partition-0" / STATE_FILE
    return partition_state(state.parent)["port"] if state.exists() else None


def test_ray_cancel_of_the_job_ends_it_cleanly(cluster: Cluster, tmp_path: Path) -> None:
    """`ray.cancel` of the task running a job: workers leave the server, the export is still
    collected, partitions shut down gracefully (final checkpoint), every actor and the placement
    group are released."""
    work = tmp_path / "work"
    options = small_job(tmp_path)
    total_cpus = ray.cluster_resources()["CPU"]
    job = ray.remote(run_job).options(num_cpus=0).remote(options, train=train_with_remote_optimizer)
    port = wait_for(lambda: partition_zero_port(work), 180, "partition 0 serving")
    with gemps.Client(f"{LOOPBACK}:{port}", timeout=30.0) as observer:
        wait_for(
            lambda: (s := observer.status()).active_workers == 2 and s.version >= 50,
            180,
            "both workers training",
            tolerate=(gemps.GempsError,),
        )
    ray.cancel(job)
    try:  # the job handles the interrupt and returns what it collected; Ray may report the cancel instead
        result = ray.get(job, timeout=180)
        assert result.stopped and result.export.version >= 50
    except ray.exceptions.TaskCancelledError:
        pass
    wait_for(
        lambda: ray.available_resources().get("CPU") == total_cpus,
        120,
        "every actor and bundle released",
        explain=lambda: f"{ray.available_resources()} {ray.util.placement_group_table()}",
    )
    logs = [(work / f"partition-{i}" / "server.log").read_text() for i in range(2)]
    assert logs[0].count("worker left") == 2, logs[0]  # both left: none was merely evicted
    for log in logs:
        stopped = re.findall(r"stopped version=(\d+)", log)
        assert len(stopped) == 1, log  # one graceful shutdown, no restart
        assert re.search(rf"checkpoint written path=\S+ version={stopped[0]} ", log), log  # its final checkpoint
