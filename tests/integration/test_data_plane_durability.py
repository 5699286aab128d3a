"""Acknowledged means durable on the data plane too (DESIGN §3b): SIGTERM while data-plane commits
are in flight, some mid-reply; every commit acknowledged before the server went is in its final
checkpoint."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from gemps_proto.dataplane import REPLY, Op
from gemps_proto.serde import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import list_checkpoints, load
from tests.data_plane_client import DataPlaneClient
from tests.helpers import wait_for
from tests.integration.conftest import StartServerProcess, open_stub

P = 2_000_000  # 8 MB replies: SIGTERM lands while some are being written
CLIENTS = 3


def commit_until_closed(reply: pb.RegisterResponse, acknowledged: list[int], errors: list[BaseException]) -> None:
    gradient = np.full(P, 1e-6, np.float32)
    try:
        with DataPlaneClient(reply.data_plane.port, timeout=30) as client:
            assert client.hello(reply.worker_id, reply.data_plane.ticket).op == Op.HELLO | REPLY
            while True:
                frame = client.commit(reply.worker_id, gradient, 0)
                if frame.op != Op.COMMIT | REPLY:
                    return
                header = pb.CommitResponse.FromString(frame.header)
                assert len(frame.payload) == 4 * P
                acknowledged.append(header.version)
    except (ConnectionError, OSError):
        return  # the server went away: what was not acknowledged is not owed
    except BaseException as error:
        errors.append(error)


def test_sigterm_mid_reply_keeps_every_acknowledged_commit(
    tmp_path: Path, start_server_process: StartServerProcess
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
        threading.Thread(target=commit_until_closed, args=(reply, acks, errors))
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
