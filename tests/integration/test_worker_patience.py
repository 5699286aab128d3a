"""The reference worker's patience (issue 43, item 6): it rides out its server's restart within
`--patience` and carries on where the restored checkpoint left θ; past it, it stops with an error
that names the option. Before, it gave up after 15 attempts (about 45 s), said nowhere."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gemps
from gemps_worker.cluster import LocalCluster
from tests.helpers import free_port, wait_for

OUTAGE_SECONDS = 8.0  # past several of the worker's retries


def test_a_worker_outlasts_a_server_restart_within_its_patience(tmp_path: Path) -> None:
    port = free_port()
    server = {"port": port, "checkpoint_dir": str(tmp_path / "checkpoints"), "checkpoint_every": 1}
    with LocalCluster(tmp_path, server=server) as cluster:  # its server started
        # 0.1 s a step: past its 10th commit it has 5 s of steps left whatever the machine's load
        # (at full speed it once finished all 60 before a loaded test stopped its server).
        worker = cluster.start_worker("w", model="mlp", max_steps=60, patience=60, epochs=50, batch_delay=0.1)
        observer = cluster.observer(timeout=30)
        wait_for(lambda: observer.status().version >= 10, 120, "the worker's first commits")
        cluster.server.close()  # SIGTERM: a final checkpoint
        time.sleep(OUTAGE_SECONDS)
        restarted = cluster.start_server()
        assert restarted.port == port
        assert worker.wait(180) == 0, (tmp_path / "w.log").read_text()
    log = (tmp_path / "w.log").read_text()
    assert "giving up after 60 s: the patience" in log  # it said it waited, and for how long it would
    assert "done: 60 commits" in log


def test_a_worker_out_of_patience_stops_naming_the_option() -> None:
    nothing = f"127.0.0.1:{free_port()}"  # no server there
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "worker", "--server", nothing, "--model", "mlp", "--patience", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert f"{nothing} did not answer for" in result.stderr
    assert "patience being 2 s" in result.stderr and "`gemps worker --patience`" in result.stderr
    assert time.monotonic() - started < 60


def test_the_sdk_reads_its_patience_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMPS_PATIENCE", "0.5")
    with (
        gemps.Client(f"127.0.0.1:{free_port()}") as client,
        pytest.raises(gemps.ServerUnavailableError, match=re.escape("patience being 0.5 s")),
    ):
        client.status()
