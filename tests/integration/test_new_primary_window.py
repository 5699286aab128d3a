"""A failover's first moments (DESIGN §3d, "Failover"): a new primary whose predecessor still lives
acknowledges nothing until that replica is seeded, so killing the new primary right after its first
acknowledgement loses nothing. Before, it acknowledged alone until then: the CI's pinned Jepsen
trial lost 107 acknowledged commits when its next fault SIGKILLed the replica promoted 0.35 s
before, and the old primary, alive, could never be promoted (no longer in the in-sync set)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

import gemps
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_server.replication.status import PRIMARY
from tests.helpers import wait_for
from tests.integration.conftest import StartServerProcess
from tests.integration.test_replicas import LEASE, PARAMETERS, primary_and_backup, replication_of

WORKERS = 3


class EpochCounters:
    """Clients committing updates of ones (θ counts the commits applied), each acknowledgement
    recorded with the epoch of the primary that gave it."""

    def __init__(self, target: str) -> None:
        self.clients = [gemps.Client(target, name=f"w{i}", timeout=60) for i in range(WORKERS)]
        self.epochs: list[list[int]] = [[] for _ in self.clients]
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(WORKERS)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        client, ones = self.clients[index], np.ones(PARAMETERS, np.float32)
        try:
            client.register({"w": np.zeros(PARAMETERS, np.float32)})
            while not self._stop.is_set():
                self.epochs[index].append(client.commit(ones, kind="update").epochs[0])
        except BaseException as error:  # reported by the test
            self.failures.append(error)

    @property
    def acknowledged(self) -> int:
        return sum(len(epochs) for epochs in self.epochs)

    def newest_epoch(self) -> int:
        return max((epochs[-1] for epochs in self.epochs if epochs), default=0)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        for client in self.clients:
            client.close()


def test_a_new_primary_killed_after_its_first_acknowledgement_loses_nothing(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    first, second, target = primary_and_backup(start_server_process, etcd, "window")
    servers = {server.target: server for server in (first, second)}
    counters = EpochCounters(target)
    wait_for(lambda: counters.acknowledged >= 30 or bool(counters.failures), 60, "commits acknowledged")
    old_epoch = counters.newest_epoch()
    # Both lose their leases with etcd frozen, and both live: whichever wins next has a predecessor
    # (or backup) alive and reachable, which a moment later asks to be its backup.
    etcd.pause()
    time.sleep(2.5 * LEASE)
    etcd.resume()
    wait_for(lambda: counters.newest_epoch() > old_epoch or bool(counters.failures), 60, "a new epoch acknowledging")
    new_epoch = counters.newest_epoch()
    promoted = next(
        server
        for address, server in servers.items()
        if (status := replication_of(address)) is not None and status.role == PRIMARY and status.epoch == new_epoch
    )
    os.kill(promoted.pid, signal.SIGKILL)  # right after its first acknowledgements
    survivor = next(server for server in servers.values() if server is not promoted)
    before = counters.acknowledged
    wait_for(
        lambda: counters.acknowledged >= before + 10 * WORKERS or bool(counters.failures),
        60,
        "commits acknowledged again, by the survivor",
        explain=lambda: repr(replication_of(survivor.target)),
    )
    counters.stop()
    assert not counters.failures, counters.failures
    with gemps.Client(survivor.target, timeout=10) as observer:
        version = observer.status().version
        theta = observer.pull().flat
    print(f"epochs {old_epoch} -> {new_epoch} (killed); {counters.acknowledged} acknowledged, {version} held")
    assert theta.min() == theta.max() == version == counters.acknowledged  # none lost, none applied twice
