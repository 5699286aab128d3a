"""Acknowledged means durable on the data plane too (DESIGN §3b): SIGTERM while data-plane commits
are in flight, some mid-reply; every commit acknowledged before the server went is in its final
checkpoint. Over TCP and through shared memory (the local socket)."""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gemps_proto.data_plane_frames import REPLY, SHARED, Op
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import list_checkpoints, load
from tests.data_plane_client import DataPlaneClient, Frame, commit_header
from tests.helpers import wait_for
from tests.integration.conftest import StartServerProcess, open_stub

P = 2_000_000  # 8 MB replies: SIGTERM lands while some are being written
CLIENTS = 3


def shared_memory(client: DataPlaneClient) -> mmap.mmap:
    """A memfd of θ's size, attached to `client`'s (local) connection."""
    fd = os.memfd_create("test-durability", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4 * P)
    os.posix_fallocate(fd, 0, 4 * P)  # written by its client first: the server maps no other
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    memory = mmap.mmap(fd, 4 * P)  # before ATTACH: then the server seals it against new writable mappings
    assert client.attach([fd], 4 * P).op == Op.ATTACH | REPLY
    os.close(fd)
    return memory


def commit_until_closed(
    reply: pb.RegisterResponse, route: str, acknowledged: list[int], errors: list[BaseException]
) -> None:
    gradient = np.full(P, 1e-6, np.float32)
    local = reply.data_plane.local_socket if route == "shared" else ""
    try:
        with DataPlaneClient(reply.data_plane.port, timeout=30, local_socket=local) as client:
            assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
            memory = shared_memory(client) if local else None
            while True:
                frame: Frame
                if memory is None:
                    frame = client.commit(reply.worker_id, gradient, 0)
                else:
                    memory[:] = gradient.tobytes()
                    client.send(Op.COMMIT, commit_header(reply.worker_id, P, 0), payload_bytes=4 * P, flags=SHARED)
                    frame = client.receive(memoryview(memory))
                if frame.op != Op.COMMIT | REPLY:
                    return
                header = pb.CommitResponse.FromString(frame.header)
                assert len(frame.payload) == 4 * P
                acknowledged.append(header.version)
    except (ConnectionError, OSError):
        return  # the server went away: what was not acknowledged is not owed
    except BaseException as error:
        errors.append(error)


@pytest.mark.parametrize(
    "route",
    ["tcp", pytest.param("shared", marks=pytest.mark.skipif(sys.platform != "linux", reason="memfd: Linux"))],
)
def test_sigterm_mid_reply_keeps_every_acknowledged_commit(
    tmp_path: Path, start_server_process: StartServerProcess, route: str
) -> None:
    server = start_server_process(
        rule="downpour", checkpoint_dir=tmp_path, checkpoint_every=0, checkpoint_interval=0, max_message_mb=64
    )
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
    first = stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(P, np.float32))))
    replies = [first] + [stub.Register(pb.RegisterRequest(spec=spec)) for _ in range(CLIENTS - 1)]
    acknowledged: list[list[int]] = [[] for _ in replies]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=commit_until_closed, args=(reply, route, acks, errors))
        for reply, acks in zip(replies, acknowledged, strict=True)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: sum(map(len, acknowledged)) >= 10, timeout=60, what="commits flowing")
    time.sleep(0.05)
    assert server.stop(timeout=60) == 0  # SIGTERM: graceful
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    final = load(list_checkpoints(tmp_path)[-1][1])
    every = sorted(v for acks in acknowledged for v in acks)
    assert every and every[-1] <= final.image.version
    assert len(set(every)) == len(every)
    np.testing.assert_allclose(final.image.theta[:5], -0.05 * 1e-6 * final.image.version, rtol=1e-4)
