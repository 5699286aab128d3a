"""`gemps ray --replicas 2` on a real multi-node Ray cluster built here (issue 35): each partition's
two replicas on distinct nodes, their primary elected through an etcd the driver starts; the node
holding partition 0's primary dies mid-run and the job goes on: etcd promotes the surviving
replica within seconds, the workers go round to it, the lost replica restarts on the third node
and rejoins as a backup (re-seeded by the primary), and no acknowledged commit is lost.

The cluster is test_ray_node_loss.py's, a head with no CPUs and three nodes, but of 2 (logical)
CPUs: the job's 9 actors of a quarter CPU each must fit on the two nodes left after the loss, or
one of them (the lost replica, the evaluator) waits for room until the job ends. A poller in this
process asks partition 0's replicas for their status every POLL seconds, for the figures (node
loss to promotion, to the next applied commit, to the rejoined backup in sync).

CI cost: about a minute and a half on 2 shared cores (docs/RAY.md states the measured figures).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback nodes
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gemps_cli.ray_job import write_outputs  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import gemps  # noqa: E402
from gemps.retry import RetryPolicy  # noqa: E402
from gemps_proto.status import BACKUP, PRIMARY  # noqa: E402
from gemps_server.checkpoint_files import load_latest  # noqa: E402
from gemps_server.replication.local_etcd import LocalEtcd  # noqa: E402
from gemps_worker.on_ray import JobFailed, RayJob, RayJobOptions  # noqa: E402
from gemps_worker.on_ray.faults import replica_name  # noqa: E402
from gemps_worker.on_ray.local import LOOPBACK, RemoveNode, local_cluster  # noqa: E402
from gemps_worker.on_ray.run import follow_job  # noqa: E402
from tests.e2e.test_ray import DEMO_BAR, NODES, SLICE, STEPS_PER_EPOCH  # noqa: E402
from tests.e2e.test_ray_node_loss import LOSS_NOTICED_IN, check_every_worker_finished  # noqa: E402
from tests.etcd_server import require_etcd  # noqa: E402

CPUS_PER_NODE = 2
EPOCHS = 10
WORKERS = 4
REPLICAS = 2
# Partition 0's version: early enough (4 workers, 10 epochs of 22 steps: 880 commits) that Ray
# marks the node dead and restarts the lost replica well before the workers finish.
LOSS_AT = 100
POLL = 0.1  # seconds between the poller's looks at partition 0's replicas
#: gemps.router's follower of partition i >= 1 asks partition 0's current session for the layout,
#: so when the node lost held both partitions' primaries a worker whose partition-1 call failed
#: first retries partition 1's dead primary until its retries are spent (not rotating to the
#: partition's other replica, which it knows), and the worker fails (reported; not fixed here)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(NODES + 1, CPUS_PER_NODE, head_cpus=0, loss_noticed_in=LOSS_NOTICED_IN) as made:
        yield made


def whole(cluster: Cluster) -> Cluster:
    while len(cluster.worker_nodes) < NODES:
        cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    return cluster


def job_options(folder: Path, **options: Any) -> RayJobOptions:
    options = {"replicas": REPLICAS, **options}
    return RayJobOptions(
        partitions=2, workers=WORKERS, epochs=EPOCHS, interval=0.5, work_dir=str(folder / "work"),
        out=str(folder / "out"), partition_cpus=SLICE, worker_cpus=SLICE, evaluator_cpus=SLICE, **options,
    )  # fmt: skip


def etcd_here(host: str) -> LocalEtcd:
    """RayJob's start_etcd, as `gemps ray` gives it (skips the test where etcd is not installed)."""
    return LocalEtcd(require_etcd(), name="gemps-ray-test", host=host)


@dataclass
class Look:
    time: float  # unix time
    target: str
    role: str
    version: int
    in_sync: int  # a primary's backups in sync


@dataclass
class Poller:
    """Partition 0's replicas' status every POLL seconds, from this process (one observer client each)."""

    job: RayJob
    looks: list[Look] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        clients: dict[str, gemps.Client] = {}
        once = RetryPolicy(max_attempts=1)
        while not self.stop.wait(POLL):
            for endpoint in list(self.job.partition_group.of(0)):
                target = endpoint.target
                try:
                    client = clients.get(target) or clients.setdefault(
                        target, gemps.Client(target, timeout=1.0, retry=once)
                    )
                    status = client.status()
                except Exception:  # a replica on the lost node, or restarting: no look
                    continue
                replication = status.replication
                assert replication is not None
                in_sync = sum(backup.in_sync for backup in replication.backups)
                self.looks.append(Look(time.time(), target, replication.role, status.version, in_sync))
        for client in clients.values():
            client.close()

    def of(self, target: str, after: float) -> list[Look]:
        return [look for look in self.looks if look.target == target and look.time >= after]


def test_the_node_of_partition_0s_primary_dies_and_the_job_goes_on_losing_no_acknowledged_commit(
    cluster: Cluster, tmp_path: Path
) -> None:
    whole(cluster)
    with RayJob(job_options(tmp_path), start_etcd=etcd_here) as job:
        assert job.etcd is not None and job.etcd.endpoint.startswith(f"https://{LOOPBACK}:")
        # STRICT_SPREAD: no node holds two replicas of a partition; workers are given both of partition 0's.
        for index in range(2):
            assert len({endpoint.node_id for endpoint in job.partition_group.of(index)}) == REPLICAS
        assert job.target.count("|") == REPLICAS - 1
        poller = Poller(job)
        polling = threading.Thread(target=poller.run, daemon=True)
        polling.start()
        loss = RemoveNode(cluster, job, LOSS_AT, partition=0)
        before = list(job.partition_group.of(0))
        try:
            result = follow_job(job, loss)
        finally:
            poller.stop.set()
            polling.join(10)
    outcomes, restarts = result.outcomes, result.restarts
    killed = next(endpoint for endpoint in before if endpoint.node_id == loss.node_id)
    survivor = next(endpoint for endpoint in before if endpoint.node_id != loss.node_id)
    held = f"{loss.held_partitions}, workers {loss.workers}; primaries of partitions {loss.primaries}"
    print(f"\nremoved node {loss.node_id[:12]} holding {held}")

    # The node held partition 0's primary, and Ray marked it dead; the job saw that, and went on.
    assert [lost.node_id for lost in result.node_losses] == [loss.node_id]
    assert replica_name(0, killed.replica) in result.node_losses[0].held
    assert not result.stopped
    # etcd promoted the survivor: the driver saw partition 0's primary change to it, after the loss.
    changes = [change for change in result.primary_changes if change.partition == 0 and change.previous >= 0]
    assert [(c.previous, c.replica) for c in changes] == [(killed.replica, survivor.replica)], result.primary_changes
    assert changes[0].seen > loss.removed
    # The lost replica came back once, on the third node (not the survivor's), and rejoined as a
    # backup: the primary counted it in sync again.
    own = [restart for restart in restarts if restart.actor == replica_name(0, killed.replica)]
    assert len(own) == 1 and own[0].node_lost and own[0].previous_node_id == loss.node_id, restarts
    back = result.partitions[killed.replica]
    assert back.node_id not in {loss.node_id, survivor.node_id} and back.starts == 2
    survivor_looks = poller.of(survivor.target, loss.removed)
    promoted = next(look.time for look in survivor_looks if look.role == PRIMARY) - loss.removed
    rejoined = next(look.time for look in survivor_looks if look.role == PRIMARY and look.in_sync >= 1) - loss.removed
    assert any(look.role == BACKUP for look in poller.of(back.target, loss.removed)), "the restarted replica"
    # Commits went on at the survivor: from the version it stood at after the loss to the next.
    settled = [look for look in survivor_looks if look.time >= loss.removed + 0.5]
    applied = next(look.time for look in settled if look.version > settled[0].version) - loss.removed
    budget = EPOCHS * STEPS_PER_EPOCH
    check_every_worker_finished(result, loss, budget)
    # No acknowledged commit lost, none applied twice: each partition's newest checkpoint (its
    # replicas' final ones) holds every acknowledged commit of the workers' last lives, and at
    # most a budget more per lost life; the two partitions agree but for a lost worker's commit
    # in flight to one of them.
    acknowledged = sum(outcome.commits for outcome in outcomes)
    work = tmp_path / "work"
    versions = []
    for index in range(2):
        found = [load_latest(folder) for folder in sorted(work.glob(f"partition-{index}/replica-*"))]
        versions.append(max(latest[1].version for latest in found if latest))
    extra = len(loss.workers) * budget
    assert acknowledged <= result.export.version <= acknowledged + extra, (acknowledged, result.export.version)
    assert all(acknowledged <= version <= acknowledged + extra for version in versions), (acknowledged, versions)
    assert abs(versions[0] - versions[1]) <= len(loss.workers), versions
    final = result.final
    assert final is not None and final.accuracy >= DEMO_BAR, final
    # gemps ray's summary says so: the loss, the replica's restart, the new primary.
    write_outputs(tmp_path / "out", result)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [lost["node_id"] for lost in summary["node_losses"]] == [loss.node_id]
    assert replica_name(0, killed.replica) in {restart["actor"] for restart in summary["restarts"]}
    assert any(change["previous"] == killed.replica for change in summary["primary_changes"])
    print(
        f"Ray marked the node dead {result.node_losses[0].seen - loss.removed:.1f}s after the loss; the survivor "
        f"was primary {promoted:.1f}s after, applied the next commit {applied:.1f}s after; the lost replica "
        f"restarted (seen {own[0].seen - loss.removed:.1f}s after) and was back in sync {rejoined:.1f}s after; "
        f"acknowledged {acknowledged}, versions {versions}, export {result.export.version}; "
        f"job {result.seconds:.1f}s; accuracy {final.accuracy:.1%}"
    )


def test_more_replicas_than_nodes_is_refused_saying_what_to_do(cluster: Cluster, tmp_path: Path) -> None:
    whole(cluster)
    options = job_options(tmp_path, replicas=NODES + 1, etcd="http://127.0.0.1:9")  # never dialled
    refused = r"--replicas 4 places each partition's replicas on distinct nodes, and 3 nodes .* --pack-replicas"
    with pytest.raises(JobFailed, match=refused), RayJob(options):
        pass
    with pytest.raises(ValueError, match="replicas need etcd"):
        RayJob(job_options(tmp_path))
