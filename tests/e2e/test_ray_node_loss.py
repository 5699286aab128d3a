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

The last two tests: no orphan partition server (issue 42, item 7), on the same cluster. The raylet
holding partition 1 is SIGKILLed alone, as when it crashes, and left unreaped. Before the fix
nothing on that node noticed (Ray's workers ask whether the raylet's pid exists): the partition's
actor and its `gemps server` lived on, the server holding its checkpoint folder's lock, and when
Ray restarted the actor on another node it failed 5 times with DirectoryInUse and the job failed
(the orphan was killed when the cluster went, without a final checkpoint).

Now the actor sees its raylet gone (it was re-parented) and stops its server gracefully: the server
is gone within a second, having written its final checkpoint, and the partition restarts on another
node from exactly that checkpoint. A user's function trains until the test has seen the restarted
partition apply AFTER_RESTART commits, so the run outlasts however long Ray takes to mark the node
dead (5 s on the test cluster: LOSS_NOTICED_IN). A second test (seconds, no cluster) covers a
restarted life that finds an earlier life's server still running on its machine.

CI cost: about three and a half minutes on 2 shared cores (docs/RAY.md states the measured figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback nodes
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gemps_cli.ray_job import write_outputs  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import gemps  # noqa: E402
from gemps.retry import RetryPolicy  # noqa: E402
from gemps_server.checkpoint_files import list_checkpoints, load_latest  # noqa: E402
from gemps_server.directory_lock import LOCK_NAME  # noqa: E402
from gemps_worker.cluster import ServerProcess  # noqa: E402
from gemps_worker.on_ray import JobFailed, RayJob, RayJobOptions, RayJobResult, WorkerContext  # noqa: E402
from gemps_worker.on_ray.faults import EVALUATOR, partition_name, worker_name  # noqa: E402
from gemps_worker.on_ray.local import LOOPBACK, RemoveNode, local_cluster, resumed_after  # noqa: E402
from gemps_worker.on_ray.records import StatusSample, TimedEvaluation  # noqa: E402
from gemps_worker.on_ray.run import follow_job  # noqa: E402
from gemps_worker.on_ray.tether import life_of, running, stop_earlier  # noqa: E402
from tests.e2e.test_ray import CPUS_PER_NODE, DEMO_BAR, NODES, ONES, SIZE, SLICE, STEPS_PER_EPOCH  # noqa: E402

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


class RemoveNodeOnceCheckpointed(RemoveNode):
    """RemoveNode once partition `partition` has a whole checkpoint in `work` from the checkpoint
    period LOSS_AT is in, or a later one. At LOSS_AT its first (at 100 commits) may still be on its
    way to the disk of a busy host, and a node lost then restarts the partition from nothing (a fresh
    clone's run: "no checkpoint to restore", the temporary removed).

    It does not wait for a recent checkpoint: a writer slower than the commits stays more than half
    a period behind until the commits stop (CI, 2026-12-03: 242 commits behind), and a removal that
    waited for one came once every worker had spent its budget (CI, 2026-12-06: the job ended before
    Ray marked the node dead, the partition never moved). What the partition may lose is what it
    applied past the newest checkpoint on disk at the removal: bounded by the checkpoint period only
    while its writer keeps up, by `sampled - checkpointed` and the removal's own time always."""

    def __init__(self, cluster: Cluster, job: RayJob, version: int, partition: int, work: Path) -> None:
        super().__init__(cluster, job, version, partition)
        self.folder = work / f"partition-{partition}"
        self.oldest = version - job.options.checkpoint_every  # a checkpoint older than this is not waited for
        self.checkpointed: int | None = None  # the newest whole checkpoint's version at the removal
        self.sampled = 0  # partition 0's version at the sample that removed the node
        self.training: set[int] = set()  # the workers still training then

    def __call__(self, sample: StatusSample, evaluation: TimedEvaluation | None) -> None:
        found = list_checkpoints(self.folder)
        if self.removed or not found or found[-1][0] < self.oldest:
            return
        training = self.job.workers.still_training()
        super().__call__(sample, evaluation)
        if self.removed:
            self.checkpointed, self.sampled, self.training = found[-1][0], sample.version, training


def check_every_worker_finished(result: RayJobResult, loss: RemoveNode, budget: int) -> None:
    """Every worker spent its whole `budget`: those on the lost node came back, on a surviving
    node, and spent it there (those that had spent it before the loss, under load, stand); every
    other one without a restart. The driver records a restart when
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
            # its last life ran elsewhere ... (a life that ran on, on the removed node: was its pid
            # among those the removal killed?)
            pid = outcome.life.pid if outcome.life is not None else None
            assert outcome.node_id != loss.node_id, (outcome, f"killed: {pid in loss.killed} ({sorted(loss.killed)})")
            assert outcome.first_commit > loss.removed  # ... and began after the loss
            print(f"worker {index}: first commit {outcome.first_commit - loss.removed:.1f}s after the loss")
        elif index in loss.finished:  # done before the loss, there; Ray may restart its idle actor
            assert outcome.node_id == loss.node_id and all(restart.node_lost for restart in own), restarts
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
        loss = RemoveNodeOnceCheckpointed(cluster, job, LOSS_AT, moving, tmp_path / "work")
        before = list(job.partitions)
        result = follow_job(job, loss)
    outcomes, restarts = result.outcomes, result.restarts
    moved = result.partitions[moving]
    print(f"\nremoved node {loss.node_id[:12]} holding partition {moving}, workers {loss.workers}; restarts {restarts}")

    # Ray marked the node dead; the partition restarted once, on another node, on a fresh port.
    ended = f"job of {result.seconds:.1f}s; node removed at version {loss.sampled}, training {sorted(loss.training)}"
    assert [lost.node_id for lost in result.node_losses] == [loss.node_id], ended
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
    assert loss.checkpointed is not None and restored >= loss.checkpointed, (restored, loss.checkpointed)
    # It lost what it had applied past that checkpoint: up to the driver's sample, and what came in
    # while the node was being removed (at most half a period and a commit per worker, as a loaded
    # host's removal has taken).
    assert 0 <= lost <= loss.sampled - loss.checkpointed + job.options.checkpoint_every // 2 + WORKERS, (
        versions, loss.sampled, loss.checkpointed,
    )  # fmt: skip
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


# -- no orphan partition server (issue 42, item 7) -----------------------------------------------

ORPHAN_SECONDS = 15.0  # the old server's time to notice its actor is gone and write its final checkpoint
AFTER_RESTART = 100  # commits the workers make through the restarted partition before they finish


def commit_until(flag: str, context: WorkerContext) -> int:
    """A user's training function: commit updates of ones until the file `flag` exists (the test
    ends the run once partition 1 came back, however long Ray took to see its node lost)."""
    retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.5)
    commits = 0
    with gemps.Client(context.target, stop=context.stop, timeout=120.0, attempt_timeout=10.0, retry=retry) as client:
        client.register({"w": np.zeros(SIZE, np.float32)})
        while not (context.stop.is_set() or os.path.exists(flag)):
            client.commit(ONES, kind="update")
            commits += 1
    return commits


def serving(pid: int, folder: str) -> bool:
    """Whether process `pid` is still a gemps server of `folder`: alive (not a zombie) and holding
    the folder's lock open (a reused pid does not). Not its command line: a server retitles itself
    (`gemps server partition 1 :PORT`), which drops the folder from /proc/PID/cmdline."""
    lock = str(Path(folder) / LOCK_NAME)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        held = {os.readlink(entry) for entry in Path(f"/proc/{pid}/fd").iterdir()}
    except (OSError, IndexError):
        return False
    return state != "Z" and lock in held


class LoseRaylet:
    """RemoveNode's progress callback (partition 1's raylet alone), then partition 1's server of
    that moment watched until it is gone: `gone_after` seconds after the loss (None: still there)."""

    def __init__(self, cluster: Cluster, job: RayJob, flag: Path) -> None:
        self.loss = RemoveNode(cluster, job, LOSS_AT, partition=1, machine=False)
        self.job, self.flag = job, flag
        self.pid, self.folder = 0, ""
        self.back_at = 0  # partition 0's version when partition 1's restart was first seen
        self.gone_after: float | None = None
        self._watch: threading.Thread | None = None

    def __call__(self, sample: StatusSample, evaluation: TimedEvaluation | None) -> None:
        if self.loss.removed:
            if self.job.partitions[1].starts > 1:
                self.back_at = self.back_at or sample.version
                if sample.version >= self.back_at + AFTER_RESTART:
                    self.flag.touch()  # the workers finish
            return
        server = self.job.partitions[1]
        self.loss(sample, evaluation)
        if self.loss.removed:
            self.pid, self.folder = server.pid, server.folder
            self._watch = threading.Thread(target=self._watch_server, daemon=True)
            self._watch.start()

    def _watch_server(self) -> None:
        while time.time() < self.loss.removed + 4 * ORPHAN_SECONDS:
            if not serving(self.pid, self.folder):
                self.gone_after = time.time() - self.loss.removed
                return
            time.sleep(0.05)

    def close(self) -> None:
        """The orphan, if any, and the lost node's processes end here rather than haunting the next tests."""
        if self._watch is not None:
            self._watch.join()
        if self.pid and serving(self.pid, self.folder):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.loss.node is not None:
            self.loss.cluster.remove_node(self.loss.node, allow_graceful=False)


def test_a_partition_server_dies_with_its_actor_and_the_restarted_actor_takes_its_folder(
    cluster: Cluster, tmp_path: Path
) -> None:
    whole(cluster)
    options = dataclasses.replace(job_options(tmp_path), evaluate=False)
    train = functools.partial(commit_until, str(tmp_path / "finish"))
    with RayJob(options, train=train, server_options={"rule": "downpour"}) as job:
        lose = LoseRaylet(cluster, job, tmp_path / "finish")
        try:
            result = follow_job(job, lose)
        finally:
            lose.close()
    print(f"\npartition 1's server (pid {lose.pid}) gone {lose.gone_after}s after its raylet; {result.restarts}")

    # The old server did not outlive its actor: gone within seconds, not when the cluster ends.
    assert lose.gone_after is not None and lose.gone_after <= ORPHAN_SECONDS, lose.gone_after
    # Partition 1 restarted once, elsewhere, and took its folder at once: no DirectoryInUse.
    moved = result.partitions[1]
    own = [restart for restart in result.restarts if restart.actor == partition_name(1)]
    assert len(own) == 1 and moved.starts == 2 and moved.node_id != lose.loss.node_id, result.restarts
    log = (Path(moved.folder) / "server.log").read_text()
    assert "in use by another gemps server" not in log, log
    # The old server wrote its final checkpoint on its way out, and the new life resumed from it.
    stopped = re.findall(r"stopped version=(\d+)", log)
    restored = re.findall(r"checkpoint restored path=\S+ version=(\d+)", log)
    assert len(stopped) == 2 and restored == [stopped[0]], (stopped, restored)
    dead, back = result.node_losses[0].seen - lose.loss.removed, own[0].seen - lose.loss.removed
    print(
        f"final checkpoint at version {stopped[0]}; Ray marked the node dead {dead:.1f}s after the raylet died "
        f"and restarted partition 1 {back:.1f}s after, from version "
        f"{restored[0]}; job {result.seconds:.1f}s"
    )
    # The job finished: every worker returned, having committed through the restarted partition.
    assert len(result.outcomes) == WORKERS and not result.stopped, result.outcomes
    assert result.export.version >= lose.back_at + AFTER_RESTART


def test_a_restarted_life_stops_an_earlier_server_still_running_here_and_takes_its_folder(tmp_path: Path) -> None:
    """Tie 3 without a cluster (seconds): a real server holds the folder as an earlier life's would
    in the moment of its final checkpoint; the new life's takeover stops it gracefully (SIGTERM,
    exit 0) and a new server takes the folder. A life recorded on another machine is left alone."""
    folder = tmp_path / "partition-1"
    with ServerProcess(checkpoint_dir=str(folder), log_path=tmp_path / "earlier.log") as earlier:
        life = life_of(earlier.pid)
        stop_earlier({**life, "boot": "another machine"}, "partition 1")
        assert earlier.returncode is None and running(life)
        stop_earlier(life, "partition 1")
        assert not running(life) and earlier.returncode == 0, earlier.log()
        assert "stopped version=0" in earlier.log()
        with ServerProcess(checkpoint_dir=str(folder), log_path=tmp_path / "later.log") as later:
            assert "in use by another gemps server" not in later.log()
