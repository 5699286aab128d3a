"""Faults between machines, on simulated hosts with real links (gemps_worker.simulated_hosts):
partitions on two hosts, workers on a third, and a cable cut and healed under them.

The workers' commits count themselves (tests/counting_worker.py: updates of ones under
`downpour`), so afterwards each partition's version is the number of commits it applied, which
must lie between the commits acknowledged to workers and those plus the ones that ended in doubt:
none applied twice, none acknowledged and lost. Between hosts the SDK takes the TCP data plane,
as between machines; `plane="grpc"` runs the same over gRPC (CommitStream past 1 MiB). Needs
root: without it each test is skipped with one line. The figures are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gemps_server.checkpoint_files import TEMPORARY_PREFIX, list_checkpoints, load
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import (
    Host,
    SharedFolder,
    SimulatedNetwork,
    shared_folder_unavailable_reason,
)
from tests.counting_fleet import CountingFleet
from tests.counting_worker import check_exactly_once, resumed_after
from tests.helpers import wait_for

PORT, DATA_PORT = 50051, 51051
WORKERS = 3
CHECKPOINT_EVERY = 200
# Reference workers, each 14 epochs of its half of digits (154 commits; 308 in all). Partition 1 is
# lost at its first checkpoint (version 200): with 10 epochs (220 in all) training ended within a
# second of the loss, and once reached 89.1% against the 90% bar; now a third of it comes after.
TRAINERS, EPOCHS = 2, 14


@dataclass
class Run:
    """Two partitions on hosts p0 and p1, counting workers on host w."""

    network: SimulatedNetwork
    folder: Path
    partitions: list[Host]
    workers_host: Host
    servers: list[ServerProcess]
    storage: SharedFolder | None = None  # checkpoints on a storage host, else in the local folder
    checkpoint_every: int = CHECKPOINT_EVERY
    healed: float = 0.0  # when the last cut cable came back (time.time())

    @property
    def target(self) -> str:
        return f"{self.partitions[0].address}:{PORT}"

    @property
    def mark_file(self) -> Path:
        return self.workers.mark_file

    @functools.cached_property
    def workers(self) -> CountingFleet:
        return CountingFleet(self.workers_host, self.folder, self.target)

    @property
    def addresses_file(self) -> Path:
        """Where each partition is: partition 0 announces what this file says now."""
        return self.folder / "addresses"

    def start_partition(self, index: int, host: Host, rule: str = "downpour", shards: int = WORKERS) -> ServerProcess:
        """Partition `index` on `host`, checkpointing into the folder every host sees (through the
        storage host's cable when there is one)."""
        command, checkpoints = host.command(GEMPS_COMMAND), self.checkpoints(index)
        if self.storage is not None:
            mount_point = self.folder / f"mount-{host.name}"
            command = host.command([*self.storage.mounted(mount_point), *GEMPS_COMMAND])
            checkpoints = mount_point / checkpoints.relative_to(self.storage.export)
        server = ServerProcess(
            log_path=self.folder / f"p{index}-{host.name}.log",
            command=command,
            host=host.address, port=PORT, data_port=DATA_PORT, rule=rule, partitions=2,
            partition_index=index, partition_addresses=f"@{self.addresses_file}", num_shards=shards,
            checkpoint_dir=str(checkpoints), checkpoint_every=self.checkpoint_every,
        )  # fmt: skip
        self.servers.append(server.start())
        return server

    def checkpoints(self, index: int) -> Path:
        """Partition `index`'s checkpoint folder as this machine sees it."""
        root = self.storage.export if self.storage is not None else self.folder
        return root / "checkpoints" / f"partition-{index}"

    def place(self, hosts: list[Host]) -> None:
        """Tell partition 0 where each partition is now (a launcher's job when one moved)."""
        self.addresses_file.write_text(",".join(f"{host.address}:{PORT}" for host in hosts) + "\n")

    def start_workers(self, *, parameters: int, plane: str, timeout: float = 5.0) -> None:
        self.workers.start(
            WORKERS, parameters=parameters, timeout=timeout, env={"GEMPS_PLANE": plane, "GEMPS_SHARED_MEMORY": "on"}
        )

    def wait_registered(self, timeout: float = 60.0) -> None:
        self.workers.wait_registered(timeout, explain=self.logs)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Stop the workers; their records and what the partitions applied."""
        return self.workers.finish()

    def cut_partition_1(self, then: float) -> None:
        """With commits flowing on both links for 2 s, partition 1's cable cut for 8 s, then healed;
        training goes on for `then` seconds."""
        time.sleep(2.0)
        self.network.cut(self.partitions[1])
        time.sleep(8.0)
        self.network.heal(self.partitions[1])
        self.healed = time.time()
        time.sleep(then)

    def check_resumed(self, fault: str) -> None:
        """Stop the workers; none of their commits applied twice or lost, and each resumed."""
        records, observed = self.finish()
        applied = check_exactly_once(records, observed)
        recovery = resumed_after(records, self.healed)
        print(f"{fault}: applied {applied}, resumed {recovery:.2f} s after the heal")

    def logs(self) -> str:
        return "\n".join(f"== {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.folder.glob("*.log")))


def start_run(
    network: SimulatedNetwork,
    folder: Path,
    first_rate: str | None = None,
    storage: SharedFolder | None = None,
    checkpoint_every: int = CHECKPOINT_EVERY,
) -> Run:
    """Partitions 0 and 1 on hosts of their own (partition 0's cable shaped to `first_rate`)."""
    hosts = [network.add_host("p0", first_rate), network.add_host("p1")]
    run = Run(network, folder, hosts, network.add_host("w"), [], storage, checkpoint_every)
    run.place(hosts)
    for index, host in enumerate(hosts):
        run.start_partition(index, host)
    return run


@pytest.mark.parametrize("plane", ["data", "grpc"])
def test_a_cable_cut_during_commits_applies_none_twice_and_training_resumes(
    network: SimulatedNetwork, tmp_path: Path, plane: str
) -> None:
    """Partition 1's cable is cut for 8 s while 3 workers commit, then healed (issue 37, item 0:
    d2dfbb8 applied a few commits twice there)."""
    run = start_run(network, tmp_path)
    run.start_workers(parameters=100_000, plane=plane)
    run.wait_registered()
    run.cut_partition_1(then=6.0)
    run.check_resumed(f"cut during commits ({plane})")


def test_a_cable_cut_during_registration_registers_once_and_commits_once(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """Partition 0 (which announces the layout) is cut off before the workers register."""
    run = start_run(network, tmp_path)
    network.cut(run.partitions[0])
    run.start_workers(parameters=100_000, plane="data", timeout=3.0)
    time.sleep(5.0)
    network.heal(run.partitions[0])
    run.wait_registered()
    time.sleep(4.0)
    records, observed = run.finish()
    applied = check_exactly_once(records, observed)
    assert all(int(r["acknowledged"][0]) > 0 for r in records)
    print(f"cut during registration: applied {applied}")


def test_a_cable_cut_during_a_streamed_registration_registers_once(network: SimulatedNetwork, tmp_path: Path) -> None:
    """The first worker uploads θ (10 MB, in pieces: RegisterStream) to partition 0 over a 100 Mbit/s
    cable, which is cut for 5 s once 4 MB of it went down: the upload stalls, the server refuses the
    stalled stream, and a registration is done again when the cable is back."""
    run = start_run(network, tmp_path, first_rate="100mbit")
    sent = network.bytes_to(run.partitions[0])
    run.start_workers(parameters=2_500_000, plane="data")
    wait_for(lambda: network.bytes_to(run.partitions[0]) - sent > 4_000_000, 60, "the upload under way")
    network.cut(run.partitions[0])
    time.sleep(5.0)
    network.heal(run.partitions[0])
    run.wait_registered()
    time.sleep(3.0)
    records, observed = run.finish()
    applied = check_exactly_once(records, observed)
    assert "RegisterStream" in (tmp_path / "p0-p0.log").read_text() or min(applied) > 0
    print(f"cut during a streamed registration: applied {applied}")


def test_a_cable_cut_during_streamed_commits_applies_none_twice(network: SimulatedNetwork, tmp_path: Path) -> None:
    """Commits of 2.4 MB per partition travel in pieces (CommitStream); the cut catches streams
    half sent, and their pieces arrive when it heals."""
    run = start_run(network, tmp_path)
    run.start_workers(parameters=1_200_000, plane="grpc")
    run.wait_registered()
    run.cut_partition_1(then=8.0)
    run.check_resumed("cut during streamed commits")


def test_a_partition_host_killed_moves_to_a_spare_host_and_the_workers_follow(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """Partition 1's host dies (every process SIGKILLed); the launcher (this test) restarts the
    partition on a spare host from the checkpoints every host sees, on its own address, and tells
    partition 0, which announces it; the workers find it there without a restart (issue 34)."""
    run = start_run(network, tmp_path)
    spare = network.add_host("spare")
    run.start_workers(parameters=100_000, plane="data")
    run.wait_registered()
    wait_for(lambda: list_checkpoints(run.checkpoints(1)), 60, "partition 1's first checkpoint", explain=run.logs)
    run.partitions[1].kill()
    killed = time.time()
    run.mark_file.write_text("killed\n")
    restored = list_checkpoints(run.checkpoints(1))[-1][0]  # the version partition 1 comes back at
    run.start_partition(1, spare)
    run.place([run.partitions[0], spare])
    time.sleep(6.0)
    records, observed = run.finish()
    v0, v1 = (int(v) for v in observed["versions"])
    acknowledged = [sum(int(r["acknowledged"][p]) for r in records) for p in (0, 1)]
    in_doubt = [sum(int(r["in_doubt"][p]) for r in records) for p in (0, 1)]
    before = sum(int(r["acknowledged_at_mark"][1]) for r in records)  # acknowledged by the dead process
    assert acknowledged[0] <= v0 <= acknowledged[0] + in_doubt[0]
    # The successor applied each commit it acknowledged once: none twice, none lost since it started.
    # Which process acknowledged a commit is told by the mark, written just after the kill: a reply of
    # the dead process that a worker read after the mark counts as the successor's (at most one each).
    after = acknowledged[1] - before
    figures = f"applied {v1} from {restored}; acknowledged {acknowledged[1]}, {before} before the kill"
    assert after - WORKERS <= v1 - restored <= after + in_doubt[1], figures
    assert after > 0, "training did not resume on the spare host"
    lost = before - restored  # acknowledged by the dead process after its newest checkpoint
    assert -WORKERS <= lost <= CHECKPOINT_EVERY + in_doubt[1], figures
    recovery = min(float(r["gap"][1]) for r in records) - killed
    print(f"partition host killed: {lost} acknowledged commits lost (newest checkpoint at {restored}), "
          f"first commit on the spare host {recovery:.2f} s after the kill")  # fmt: skip


def test_training_survives_its_partition_host_and_reaches_the_demos_bar(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """Two reference workers (`gemps worker`, digits, GEM) train while partition 1's host dies and
    the partition comes back on a spare host: every worker finishes its budget, and the central
    variable reaches the demo's held-out bar (tests/e2e/test_demo.py: 90%)."""
    hosts = [network.add_host("p0"), network.add_host("p1")]
    run = Run(network, tmp_path, hosts, network.add_host("w"), [])
    run.place(hosts)
    for index, host in enumerate(hosts):
        run.start_partition(index, host, rule="gem", shards=TRAINERS)
    spare = network.add_host("spare")
    workers = []
    for index in range(TRAINERS):
        argv = [*GEMPS_COMMAND, "worker", "--server", run.target, "--dataset", "digits", "--epochs", str(EPOCHS),
                "--name", f"trainer-{index}", "--threads", "1", "--seed", str(index)]  # fmt: skip
        workers.append(run.workers_host.start(argv, log_path=tmp_path / f"trainer-{index}.log"))
    wait_for(lambda: list_checkpoints(run.checkpoints(1)), 120, "partition 1's first checkpoint", explain=run.logs)
    run.partitions[1].kill()
    run.start_partition(1, spare, rule="gem", shards=TRAINERS)
    run.place([hosts[0], spare])
    for worker in workers:
        assert worker.wait(240) == 0, run.logs()
    assert "worker joined" in (tmp_path / "p1-spare.log").read_text()  # they followed it there
    evaluate = [sys.executable, "-m", "tests.held_out_accuracy", "--target", run.target]
    measured = subprocess.run(run.workers_host.command(evaluate), capture_output=True, text=True, timeout=120)
    assert measured.returncode == 0, measured.stderr
    accuracy = float(json.loads(measured.stdout)["accuracy"])
    print(f"training across a partition host's loss: held-out accuracy {accuracy:.2%}")
    assert accuracy >= 0.90, run.logs()


def test_a_cable_cut_during_a_shared_checkpoint_write_stops_no_commit_and_leaves_a_good_checkpoint(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """Checkpoints go to a storage host (sshfs, as a network filesystem would), over a 50 Mbit/s
    cable that is cut for 8 s while a checkpoint is being written: the write stalls and fails,
    commits go on meanwhile, and once the cable is back the next checkpoint is written whole."""
    reason = shared_folder_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    storage_host = network.add_host("storage", rate="50mbit")
    storage = SharedFolder(storage_host, tmp_path / "shared", tmp_path / "keys")
    run = start_run(network, tmp_path, storage=storage, checkpoint_every=100)  # set before the partitions start
    run.start_workers(parameters=2_000_000, plane="data")  # 4 MB per partition: 0.7 s to write
    run.wait_registered()
    folder = run.checkpoints(1)
    wait_for(lambda: any(folder.glob(f"{TEMPORARY_PREFIX}*")), 120, "a checkpoint being written", explain=run.logs)
    network.cut(storage_host)
    cut = time.time()
    time.sleep(8.0)
    network.heal(storage_host)
    healed = time.time()
    written = {version for version, _ in list_checkpoints(folder)}
    wait_for(
        lambda: {version for version, _ in list_checkpoints(folder)} - written,
        120,
        "a checkpoint written after the cable healed",
        explain=run.logs,
    )
    records, observed = run.finish()
    check_exactly_once(records, observed)
    newest = list_checkpoints(folder)[-1][1]
    assert load(newest).version > 0  # whole: its CRC and checks pass
    # A temporary may remain (the next write under way as the test ends, or one the cut kept from
    # being removed, which a restart removes): it is never listed or loaded as a checkpoint.
    assert all(not path.name.startswith(TEMPORARY_PREFIX) for _, path in list_checkpoints(folder))
    longest = max(float(r["gap"][1]) - float(r["gap"][0]) for r in records)
    print(f"storage cut for {healed - cut:.1f} s during a checkpoint write: longest wait between commits "
          f"{longest:.2f} s; newest checkpoint {newest.name}")  # fmt: skip
    assert longest < healed - cut, "commits stopped while the checkpoint storage was cut off"
