"""The server's parts behind one lifecycle (gemps_server/lifecycle.py): a start that fails late
leaves nothing of the server behind in the process that tried, as `gemps server` exiting 2 would."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gemps_server.directory_lock import DirectoryLock
from tests.helpers import InProcessServer, free_port, replication_secret_file


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another listener holds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield int(holder.getsockname()[1])


def refused(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_start_failing_late_leaves_nothing_serving(tmp_path: Path, busy_port: int) -> None:
    """The replication port in use: the last part to start fails after the doors serve, the tasks
    run and the checkpoint directory is held; every one of them is let go of."""
    # Every port from the suite's band: one the kernel chose (port 0) may be given to another test's
    # listener the moment this server lets go of it (CI met the metrics port so, "still accepting").
    grpc_port, data_port, metrics_port = free_port(), free_port(), free_port()
    server = InProcessServer(
        port=grpc_port,
        data_port=data_port,
        metrics_port=metrics_port,
        checkpoint_dir=str(tmp_path),
        replicas=2,
        replica_index=0,
        etcd="http://127.0.0.1:9",  # never reached: the listener is bound before the election starts
        job="late",
        replication_secret_file=replication_secret_file(),
        replication_port=busy_port,
    )
    with pytest.raises(OSError, match="replication: cannot listen"):
        server.start()
    inner = server.server
    assert (inner.port, inner.data_port, inner.metrics_port) == (grpc_port, data_port, metrics_port)  # each was bound
    for port in (grpc_port, data_port, metrics_port):
        assert refused(port), f"port {port} still accepts connections"
    pending = {task.get_name() for task in asyncio.all_tasks(server._loop)}
    assert not pending & {"gemps-leases", "gemps-heap-trim", "gemps-checkpoints"}, pending
    lock = DirectoryLock(tmp_path)
    lock.acquire()  # DirectoryInUse while the failed server held it
    lock.release()
    with InProcessServer(port=grpc_port, data_port=data_port, checkpoint_dir=str(tmp_path)) as again:
        assert again.port == grpc_port  # the same ports and directory serve a new server at once
