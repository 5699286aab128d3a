"""A partitioned server's state seen from outside: `gemps status` and `gemps export` assemble every
partition (live and from checkpoints), refuse partitions at different versions, and a partition's
checkpoint refuses a server of another layout.

These are the server's and the command line's (gRPC) paths: unlike test_partitions.py they do not
run once per client plane (shared memory, data plane over TCP, gRPC), which reaches θ the same way.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from gemps import Client
from gemps_proto.schema import partition_bounds
from gemps_server.checkpoint_files import list_checkpoints
from gemps_worker.cluster import ServerProcess
from tests.helpers import scrape_series, wait_for
from tests.integration.test_partitions import initial


def gemps_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gemps_cli", *argv], capture_output=True, text=True, timeout=120)


def test_status_and_export_assemble_every_partition(tmp_path: Path) -> None:
    """`gemps server --partitions 3`: `gemps status` lists each partition, `gemps export` writes
    the whole θ, live and from the per-partition checkpoint directories, and a restart of the
    whole server restores each partition from its own."""
    options: dict[str, Any] = {"partitions": 3, "checkpoint_dir": tmp_path / "ckpt", "checkpoint_every": 1}
    with ServerProcess(**options) as server, Client(server.target, timeout=10) as client:
        client.register(initial(0), {"running_mean": np.arange(5, dtype=np.float32)})
        trained = client.commit(np.ones(10_007, np.float32)).parameters
        status = gemps_command("status", "--server", server.target)
        assert status.returncode == 0, status.stderr
        assert "parameters      10007 in 3 tensors" in status.stdout
        assert "partitions      3" in status.stdout
        assert "noise scale     no estimate (no gradient commits measured yet" in status.stdout  # 1 commit of 2
        for index, (start, stop) in enumerate(partition_bounds(10_007, 3)):
            assert re.search(
                rf"  {index}  127\.0\.0\.1:\d+ +values {start}\.\.{stop - 1}  version 1  workers 1", status.stdout
            )
        # One Prometheus target for the three: each partition's series under its label.
        series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        for index in range(3):
            assert series[f'gemps_partition_up{{partition="{index}"}}'] == 1
            assert series[f'gemps_central_version{{partition="{index}"}}'] == 1
            assert series[f'gemps_parameters{{partition="{index}"}}'] == np.diff(partition_bounds(10_007, 3)[index])[0]
        wait_for(lambda: all(list_checkpoints(tmp_path / "ckpt" / f"partition-{i}") for i in range(3)), 30)
        for source in (["--server", server.target], [str(tmp_path / "ckpt")]):
            out = tmp_path / "model.safetensors"
            result = gemps_command("export", *source, "--out", str(out))
            assert result.returncode == 0, result.stderr
            assert "version 1, 4 tensors, 10007 parameters, 5 buffer values" in result.stdout
            exported = safetensors.numpy.load_file(str(out))
            for name, value in trained.state_dict().items():
                np.testing.assert_array_equal(exported[name], value)
    with ServerProcess(**options) as server, Client(server.target, timeout=10) as observer:
        restored = observer.pull()
        assert restored.versions == (1, 1, 1)
        np.testing.assert_array_equal(restored.flat, trained.flat)
        np.testing.assert_array_equal(restored.buffers, trained.buffers)
    one = gemps_command("export", str(tmp_path / "ckpt" / "partition-1"), "--out", str(tmp_path / "x"))
    assert one.returncode == 1 and "partition 1 of 3" in one.stderr


def written(directory: Path, version: int) -> bool:
    """Both partitions' newest checkpoints are at `version`."""
    return all((found := list_checkpoints(directory / f"partition-{i}")) and found[-1][0] == version for i in range(2))


def test_export_refuses_partitions_at_different_versions_unless_asked(tmp_path: Path) -> None:
    """Issue 28: partition 1 restarted from an older checkpoint than partition 0's (as after a
    SIGKILL) holds θ's range at another version. `gemps export` names every partition's version and
    refuses the mix, from the checkpoints and from the live server, unless --allow-mixed-versions."""
    options: dict[str, Any] = {"partitions": 2, "checkpoint_dir": tmp_path / "ckpt", "checkpoint_every": 1}
    with ServerProcess(**options) as server, Client(server.target, timeout=10) as client:
        client.register(initial(0))
        for version in range(1, 4):
            client.commit(np.ones(10_007, np.float32))
            # each version on disk before the next commit: a busy writer would otherwise skip to the newest
            wait_for(functools.partial(written, tmp_path / "ckpt", version), 30, f"checkpoints at version {version}")
    newest = list_checkpoints(tmp_path / "ckpt" / "partition-1")[-1]
    assert newest[0] == 3
    newest[1].unlink()  # partition 1's newest is now an older one's
    older = list_checkpoints(tmp_path / "ckpt" / "partition-1")[-1][0]
    assert older < 3
    out = tmp_path / "model.safetensors"
    refused = gemps_command("export", str(tmp_path / "ckpt"), "--out", str(out))
    assert refused.returncode == 1, refused.stdout
    assert f"partition versions: 0: 3, 1: {older}" in refused.stdout
    assert f"partition 0 at 3, partition 1 at {older}" in refused.stderr and "--allow-mixed-versions" in refused.stderr
    assert not out.exists()
    allowed = gemps_command("export", str(tmp_path / "ckpt"), "--out", str(out), "--allow-mixed-versions")
    assert allowed.returncode == 0, allowed.stderr
    assert f"partition versions: 0: 3, 1: {older}" in allowed.stdout
    assert "different versions, as asked" in allowed.stdout
    assert safetensors.safe_open(str(out), "numpy").metadata()["partition_versions"] == f"3,{older}"
    with ServerProcess(**options) as server:  # restored from those: the live server holds the mix too
        live = gemps_command("export", "--server", server.target, "--out", str(tmp_path / "live.safetensors"))
        assert live.returncode == 1 and f"partition 0 at 3, partition 1 at {older}" in live.stderr


def test_a_partitions_checkpoint_is_refused_by_a_server_of_another_layout(tmp_path: Path) -> None:
    """A partition's checkpoint holds its range only: started as another partition, or as a whole
    server, the process refuses to start (exit 2) rather than serve a wrong θ."""
    with ServerProcess(partitions=2, checkpoint_dir=tmp_path) as server, Client(server.target, timeout=10) as client:
        client.register(initial(0))
    layouts: list[dict[str, Any]] = [{}, {"partitions": 2, "partition_index": 0, "partition_addresses": ",:1"}]
    for options in layouts:
        wrong = ServerProcess(checkpoint_dir=tmp_path / "partition-1", **options)
        with pytest.raises(RuntimeError, match="exited with 2"):
            wrong.start()
        assert "the checkpoint holds partition 1 of 2; this server serves partition 0 of" in wrong.log()
