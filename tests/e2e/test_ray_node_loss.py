"""A Ray node lost mid-run, on a real multi-node cluster built here: the workers it held come back
on surviving nodes and the job finishes (issue 34, item 1); a partition on a lost node comes back
on another node from its checkpoints, the workers follow it and the job finishes (item 2); a
worker or a partition whose restarts are spent ends the job, saying which, how many and why.

The cluster is a head with no CPUs (as Ray advises for real clusters: no actor lands there, so
any node holding the job's actors can be lost without ending the cluster) and three nodes of 1
CPU, as the issue's. `RayJob(partitions=2, workers=4)` trains digits with the reference workers
and the evaluator; once partition 0's version passes LOSS_AT, the node that holds workers and no
partition (or partition 1's) is removed without a drain, every process on it killed, as a
machine dies.

CI cost: about three minutes on 2 shared cores (docs/RAY.md states the measured figures).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback nodes
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gemps_cli.ray_job import write_outputs  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from gemps_server.checkpoint_files import load_latest  # noqa: E402
from gemps_worker.on_ray import JobFailed, RayJob, RayJobOptions, RayJobResult  # noqa: E402
from gemps_worker.on_ray.faults import EVALUATOR, partition_name, worker_name  # noqa: E402
from gemps_worker.on_ray.local import LOOPBACK, RemoveNode, local_cluster, resumed_after  # noqa: E402
from gemps_worker.on_ray.run import follow_job  # noqa: E402
from tests.e2e.test_ray import CPUS_PER_NODE, DEMO_BAR, NODES, SLICE, STEPS_PER_EPOCH  # noqa: E402

EPOCHS = 8
WORKERS = 4
LOSS_AT = 120  # partition 0's version: mid-run (4 workers, 8 epochs of 22 steps: 704 commits)
# Ray marks a lost node dead after this many seconds of failed health checks (its defaults: 13-22 s
# here, which docs/RAY.md's runs measure); what follows the loss is what these tests check.
LOSS_NOTICED_IN = 5.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(NODES + 1, CPUS_PER_NODE, head_cpus=0, loss_noticed_in=LOSS_NOTICED_IN) as made:
        yield made


def job_options(folder: Path, **options: Any) -> RayJobOptions:
    return RayJobOptions(
        partitions=2, workers=WORKERS, epochs=EPOCHS, interval=0.5, work_dir=str(folder / "work"),
        out=str(folder / "out"), partition_cpus=SLICE, worker_cpus=SLICE, evaluator_cpus=SLICE, **options,
    )  # fmt: skip


def whole(cluster: Cluster) -> Cluster:
    """The cluster with its 3 CPU nodes again: a test before may have lost one."""
    while len(cluster.worker_nodes) < NODES:
        cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    return cluster


def check_every_worker_finished(result: RayJobResult, loss: RemoveNode, budget: int) -> None:
    """Every worker spent its whole `budget`: those on the lost node came back, on a surviving
    node, and spent it there; every other one without a restart. The driver records a restart when
    one of its periodic looks, or the outcome a worker returns, shows the actor on a new node (on a
    loaded machine a restarted worker could finish before a look reached it: 2 runs in full
    suites before outcomes carried their life); the record is asked of one lost worker at least,
    the moves themselves of each."""
    outcomes, restarts = result.outcomes, result.restarts
    assert [outcome.commits for outcome in outcomes] == [budget] * len(outcomes), outcomes
    assert not any(outcome.stopped_early or outcome.diverged for outcome in outcomes)
    lost = {worker_name(index) for index in loss.workers}
    if lost:
        recorded = [r for r in restarts if r.actor in lost and r.node_lost and r.previous_node_id == loss.node_id]
        assert recorded, restarts
    for index, outcome in enumerate(outcomes):
        own = [restart for restart in restarts if restart.actor == worker_name(index)]
        if index in loss.workers:
            assert len(own) <= 1 and all(restart.node_lost for restart in own), restarts
            assert outcome.node_id != loss.node_id  # its last life ran elsewhere ...
            assert outcome.first_commit > loss.removed  # ... and began after the loss
            print(f"worker {index}: first commit {outcome.first_commit - loss.removed:.1f}s after the loss")
        else:
            assert not own, restarts


def test_workers_on_a_lost_node_come_back_elsewhere_and_the_job_finishes(cluster: Cluster, tmp_path: Path) -> None:
    whole(cluster)
    with RayJob(job_options(tmp_path)) as job:
        loss = RemoveNode(cluster, job, LOSS_AT)
        result = follow_job(job, loss)
    outcomes, restarts = result.outcomes, result.restarts
    print(f"\nremoved node {loss.node_id[:12]} holding workers {loss.workers}; restarts {restarts}")

    # The node held workers and no partition, and Ray marked it dead; the job saw that.
    assert loss.workers, "no worker on the node removed"
    assert loss.node_id not in {partition.node_id for partition in result.partitions}
    assert [lost.node_id for lost in result.node_losses] == [loss.node_id]
    assert {worker_name(index) for index in loss.workers} <= set(result.node_losses[0].held)
    budget = EPOCHS * STEPS_PER_EPOCH
    check_every_worker_finished(result, loss, budget)
    # Partition 0 applied every acknowledged commit of the workers' last lives, and no more than
    # the lost lives could have added (each at most its budget): nothing applied twice.
    acknowledged = sum(outcome.commits for outcome in outcomes)
    assert acknowledged <= result.export.version <= acknowledged + len(loss.workers) * budget
    # The demo's bar, measured by the evaluator actor on the final θ; had the evaluator been on the
    # lost node, it came back too, and the driver kept its figures from both lives.
    final, evaluations = result.final, result.evaluations
    assert final is not None and final.accuracy >= DEMO_BAR, final
    if EVALUATOR in result.node_losses[0].held:
        assert [restart.actor for restart in restarts].count(EVALUATOR) == 1, restarts
        # Its second life reported (the first may not have yet when the node went: under a full
        # suite's load its first look can come after the loss, as in one fresh-clone run).
        before = [evaluation for evaluation in evaluations if evaluation.time < loss.removed]
        assert len(evaluations) > len(before), evaluations
    # gemps ray's summary records the loss and the restarts.
    write_outputs(tmp_path / "out", result)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [lost["node_id"] for lost in summary["node_losses"]] == [loss.node_id]
    assert {restart["actor"] for restart in summary["restarts"]} >= {worker_name(i) for i in loss.workers}


@pytest.mark.parametrize("moving", [1, 0])
def test_a_partition_on_a_lost_node_moves_to_another_and_the_job_finishes(
    cluster: Cluster, tmp_path: Path, moving: int
) -> None:
    """A partition's node dies: Ray places its bundle on a surviving node and restarts its actor
    there, from its newest checkpoint in --work-dir, on fresh ports. Partition 1 moved: partition
    0 announces its new address and the workers follow it; partition 0 moved: the workers ask its
    actor where it is now (issue 34, item 2)."""
    whole(cluster)
    staying = 1 - moving
    with RayJob(job_options(tmp_path)) as job:
        loss = RemoveNode(cluster, job, LOSS_AT, partition=moving)
        before = list(job.partitions)
        result = follow_job(job, loss)
    outcomes, restarts = result.outcomes, result.restarts
    moved = result.partitions[moving]
    print(f"\nremoved node {loss.node_id[:12]} holding partition {moving}, workers {loss.workers}; restarts {restarts}")

    # Ray marked the node dead; the partition restarted once, on another node, on a fresh port.
    assert [lost.node_id for lost in result.node_losses] == [loss.node_id]
    assert partition_name(moving) in result.node_losses[0].held
    own = [restart for restart in restarts if restart.actor == partition_name(moving)]
    assert len(own) == 1 and own[0].node_lost and own[0].previous_node_id == loss.node_id, restarts
    assert moved.node_id != loss.node_id and moved.starts == 2 and moved.target != before[moving].target
    assert result.partitions[staying] == before[staying]  # the other stayed where it was
    budget = EPOCHS * STEPS_PER_EPOCH
    check_every_worker_finished(result, loss, budget)
    # No commit applied twice. The partition that stayed applied every acknowledged commit of the
    # workers' last lives, and at most a budget more per lost life. The one that moved resumed from
    # its newest checkpoint and applied each later commit once: it is behind by what it had
    # applied after that checkpoint (lost), never ahead.
    acknowledged = sum(outcome.commits for outcome in outcomes)
    work = tmp_path / "work"
    versions = [found[1].version for found in map(load_latest, sorted(work.glob("partition-*"))) if found]
    log = (work / f"partition-{moving}" / "server.log").read_text()
    restored = int(re.findall(r"checkpoint restored path=\S+ version=(\d+)", log)[-1])
    assert acknowledged <= versions[staying] <= acknowledged + len(loss.workers) * budget, versions
    lost = versions[staying] - versions[moving]
    assert 0 <= lost <= job.options.checkpoint_every + WORKERS, versions
    assert LOSS_AT - job.options.checkpoint_every <= restored <= versions[moving], (restored, versions)
    final = result.final
    assert final is not None and final.accuracy >= DEMO_BAR, final
    # gemps ray's summary records the loss and the partition's restart.
    write_outputs(tmp_path / "out", result)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [lost["node_id"] for lost in summary["node_losses"]] == [loss.node_id]
    assert partition_name(moving) in {restart["actor"] for restart in summary["restarts"]}
    resumed = resumed_after(result.samples, loss.removed)
    assert resumed is not None, result.samples
    print(
        f"Ray marked the node dead {result.node_losses[0].seen - loss.removed:.1f}s after the loss; partition {moving} "
        f"restored at version {restored}, seen restarted {own[0].seen - loss.removed:.1f}s after; commits resumed "
        f"{resumed:.1f}s after; {lost} acknowledged commits lost; "
        f"job {result.seconds:.1f}s; accuracy {final.accuracy:.1%}"
    )


def test_a_partition_whose_restarts_are_spent_ends_the_job_saying_which_how_many_and_why(
    cluster: Cluster, tmp_path: Path
) -> None:
    whole(cluster)
    with RayJob(job_options(tmp_path, partition_restarts=0)) as job:
        loss = RemoveNode(cluster, job, LOSS_AT, partition=1)
        with pytest.raises(JobFailed) as failed:
            follow_job(job, loss)
    print(f"\n{failed.value}")
    expected = (
        rf"partition 1 failed for good after 0 restarts \(--partition-restarts 0\): "
        rf"its node {loss.node_id[:12]} was lost; ActorDiedError: "
    )
    assert re.match(expected, str(failed.value)), failed.value


def test_a_worker_whose_restarts_are_spent_ends_the_job_saying_which_how_many_and_why(
    cluster: Cluster, tmp_path: Path
) -> None:
    whole(cluster)
    with RayJob(job_options(tmp_path, worker_restarts=0)) as job:
        loss = RemoveNode(cluster, job, LOSS_AT)
        with pytest.raises(JobFailed) as failed:
            follow_job(job, loss)
    print(f"\n{failed.value}")
    which = "|".join(map(str, loss.workers))
    expected = (
        rf"worker ({which}) failed for good after 0 restarts \(--worker-restarts 0\): "
        rf"its node {loss.node_id[:12]} was lost; ActorDiedError: "
    )
    assert re.match(expected, str(failed.value)), failed.value
