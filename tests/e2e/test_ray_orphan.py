"""No orphan partition server on Ray (issue 42, item 7), on the node-loss tests' real multi-node
cluster: the raylet holding partition 1 is SIGKILLed alone, as when it crashes, and left unreaped.
Before the fix nothing on that node noticed (Ray's workers ask whether the raylet's pid exists): the
partition's actor and its `gemps server` lived on, the server holding its checkpoint folder's lock,
and when Ray restarted the actor on another node it failed 5 times with DirectoryInUse and the job
failed (the orphan was killed when the cluster went, without a final checkpoint).

Now the actor sees its raylet gone (it was re-parented) and stops its server gracefully: the server
is gone within a second, having written its final checkpoint, and the partition restarts on another
node from exactly that checkpoint. A user's function trains until the test has seen the restarted
partition apply AFTER_RESTART commits, so the run outlasts however long Ray takes to mark the node
dead (5 s on the test cluster: LOSS_NOTICED_IN). A second test (seconds, no cluster) covers a
restarted life that finds an earlier life's server still running on its machine.

CI cost: about 30 s on 2 shared cores, on the node-loss tests' cluster fixture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback nodes
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402

import gemps  # noqa: E402
from gemps.retry import RetryPolicy  # noqa: E402
from gemps_server.directory_lock import LOCK_NAME  # noqa: E402
from gemps_worker.cluster import ServerProcess  # noqa: E402
from gemps_worker.on_ray import RayJob, WorkerContext  # noqa: E402
from gemps_worker.on_ray.faults import partition_name  # noqa: E402
from gemps_worker.on_ray.local import RemoveNode  # noqa: E402
from gemps_worker.on_ray.records import StatusSample, TimedEvaluation  # noqa: E402
from gemps_worker.on_ray.run import follow_job  # noqa: E402
from gemps_worker.on_ray.tether import life_of, running, stop_earlier  # noqa: E402
from tests.e2e import test_ray_node_loss as node_loss  # noqa: E402
from tests.e2e.test_ray import ONES, SIZE  # noqa: E402
from tests.e2e.test_ray_node_loss import LOSS_AT, WORKERS, job_options, whole  # noqa: E402

cluster = node_loss.cluster  # the node-loss tests' cluster: a head with no CPUs and 3 nodes of 1 CPU
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
