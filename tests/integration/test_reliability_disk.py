"""A checkpoint disk that holds exactly `--checkpoint-keep` files (issue 15, item 5): the server
makes room by pruning early (never the newest) instead of failing every write from then on."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import list_checkpoints, load
from tests.helpers import wait_for
from tests.integration.conftest import StartServer, open_stub

# 15,000 float32 values: about 61 KB a file, so a 200 KiB file system holds 3 and not 4.
SIZE = 15_000
KEEP = 3


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "disk"
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and mount rights): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def test_a_disk_that_holds_exactly_keep_checkpoints_keeps_taking_new_ones(
    start_server: StartServer, small_disk: Path
) -> None:
    server = start_server(
        checkpoint_dir=str(small_disk), checkpoint_every=1, checkpoint_interval=0, checkpoint_keep=KEEP
    )
    stub = open_stub(server.target)
    spec = [pb.ParameterSpec(name="w", shape=[SIZE], dtype=pb.DTYPE_FLOAT32)]
    initial = tensor_to_proto(np.zeros(SIZE, np.float32))
    worker_id = stub.Register(pb.RegisterRequest(spec=spec, initial_parameters=initial)).worker_id
    checkpointer = server.server.checkpointer
    assert checkpointer is not None
    for version in range(1, 2 * KEEP + 2):
        stub.Commit(
            pb.CommitRequest(
                worker_id=worker_id,
                base_version=version - 1,
                kind=pb.PAYLOAD_KIND_UPDATE,
                payload=tensor_to_proto(np.full(SIZE, 1e-3, np.float32)),
            )
        )
        # One checkpoint per commit, each waited for, so the disk fills up for certain.
        wait_for(
            lambda v=version: checkpointer.last_version == v or checkpointer.failed,  # type: ignore[misc]
            timeout=20,
            what=f"checkpoint {version}",
        )
        assert not checkpointer.failed, f"checkpoint {version} failed:\n{server.log()[-2000:]}"
    found = list_checkpoints(small_disk)
    assert [version for version, _ in found] == [2 * KEEP - 1, 2 * KEEP, 2 * KEEP + 1]
    assert load(found[-1][1]).version == 2 * KEEP + 1
    assert "checkpoint disk full: pruned early" in server.log()
