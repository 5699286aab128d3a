"""Issue 37, item 4: workers that end without close(), against real servers.

PyTorch's examples never call close(): such a worker stayed "active" in `gemps status` until its
lease expired (60 s by default). Now a registered client leaves at interpreter exit (gemps.at_exit),
within a short deadline, and `gemps status` says when each worker was last seen.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from gemps_cli.main import main as gemps_main

from gemps import Client
from gemps.pytorch import LocalSteps, RemoteModel, RemoteOptimizer
from tests.helpers import InProcessServer, stop_process
from tests.integration.conftest import StartServer, StartServerProcess

pytestmark = pytest.mark.timeout(120)

# A worker as PyTorch's examples write one: it trains, then ends without close(); with "--wait" it
# first waits for a line on stdin (the test stops the server meanwhile).
WORKER = textwrap.dedent(
    """
    import sys
    import torch
    from gemps.pytorch import RemoteOptimizer

    model = torch.nn.Linear(3, 2)
    optimizer = RemoteOptimizer(model, sys.argv[1], name="no-close")
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    print("committed", flush=True)
    if "--wait" in sys.argv:
        sys.stdin.readline()
    """
)

# Longer than any test here: a worker gone from the server left, it was not evicted.
LONG_LEASE = 600.0


def start_worker(target: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, target, *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_worker_that_ends_without_close_leaves_the_server(start_server: StartServer) -> None:
    server = start_server(lease_ttl=LONG_LEASE)
    worker = start_worker(server.target)
    out, err = worker.communicate(timeout=90)
    assert worker.returncode == 0 and out == "committed\n", err
    # Nothing but the SDK's one warning that step() sent no loss (gemps.pytorch.batches).
    assert [line for line in err.splitlines() if "commits no loss" not in line] == [], err
    with Client(server.target) as observer:  # d2dfbb8: 1 active for LONG_LEASE seconds
        status = observer.status()
        assert (status.active_workers, status.commits_applied) == (0, 1)
        assert status.workers == ()
    assert "worker left" in server.log()


def test_exit_is_not_held_up_by_an_unreachable_server(start_server_process: StartServerProcess) -> None:
    """A server that stops answering (here SIGSTOPped: connections stay open, requests hang) costs
    the exiting worker at most the leave's short deadline, not its calls' 60 s deadline."""
    server = start_server_process(lease_ttl=LONG_LEASE)
    worker = start_worker(server.target, "--wait")
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "committed\n"
        stop_process(server.pid)
        started = time.monotonic()
        _, err = worker.communicate("end\n", timeout=60)
        took = time.monotonic() - started
    finally:
        os.kill(server.pid, signal.SIGCONT)
        worker.kill()
    assert worker.returncode == 0, err
    assert took < 15, f"exit took {took:.1f}s"


def test_gemps_status_says_when_each_worker_was_last_seen(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gemps status` lists the registered workers, the longest unseen first (d2dfbb8: only a count)."""
    params = {"w": np.zeros(2, np.float32)}
    with Client(server.target, name="busy") as busy, Client(server.target, name="quiet") as quiet:
        busy.register(params)
        quiet.register(params)
        busy.commit(params)  # seen after quiet's registration: quiet is the longer unseen
        assert gemps_main(["status", "--server", server.target]) == 0
        shown = capsys.readouterr().out
        statuses = busy.status()
    assert "active workers  2 (each evicted after 60s unseen)\n" in shown
    assert "\nworkers         the longest unseen first\n" in shown
    rows = re.findall(
        r"^  shard (\d)    (\w+) +last seen [\d.]+s ago, last commit [\d.]+s ago, (\d) commits, "
        r"[\d.]+/s, staleness [\d.]+, π (?:-|[\d.]+ \(\d+% at 0, \d+% at max\)) \(last [\d.]+s\)$",
        shown,
        re.M,
    )
    assert rows == [("1", "quiet", "0"), ("0", "busy", "1")]
    assert [(w.name, w.shard, w.commits) for w in statuses.workers] == [("busy", 0, 1), ("quiet", 1, 0)]
    assert statuses.lease_ttl_seconds == 60.0
    assert all(0 <= w.seconds_since_seen <= w.seconds_since_commit for w in statuses.workers)


def test_a_block_left_on_an_error_does_not_wait_out_the_patience_to_leave(start_server: StartServer) -> None:
    """A `with Client(...)` block that ends on an error, its server gone meanwhile: one attempt to
    leave (close's, within its short deadline), not `leave()`'s retries until the client's patience
    runs out. Before, the error reached its caller only after the patience (300 s by default: a test
    whose server had failed over waited 600 s, the commit's retries and then the leave's)."""
    server = start_server(lease_ttl=LONG_LEASE)
    client = Client(server.target, name="failing", patience=5)
    with pytest.raises(RuntimeError, match="the program's own error"), client:
        client.register({"w": np.zeros(2, np.float32)})
        server.stop()
        raise RuntimeError("the program's own error")
    assert client.retries == 0  # before: every attempt of the 5 s of patience retried


# gemps.pytorch's wrappers that open their client: each block's error is not held up by leaving.
WRAPPERS: dict[str, Callable[[torch.nn.Module, str], Any]] = {
    "RemoteModel": lambda model, target: RemoteModel(model, target, name="failing", patience=5),
    "RemoteOptimizer": lambda model, target: RemoteOptimizer(model, target, name="failing", patience=5),
    "LocalSteps": lambda model, target: LocalSteps(
        model, torch.optim.SGD(model.parameters(), lr=0.1), target, name="failing", patience=5
    ),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_torch_wrappers_block_left_on_an_error_does_not_wait_out_the_patience_to_leave(
    start_server: StartServer, wrapper: str
) -> None:
    server = start_server(lease_ttl=LONG_LEASE)
    made = WRAPPERS[wrapper](torch.nn.Linear(3, 2), server.target)
    with pytest.raises(RuntimeError, match="the program's own error"), made:
        server.stop()
        raise RuntimeError("the program's own error")
    remote: RemoteModel = made if isinstance(made, RemoteModel) else made.remote
    assert remote.client.retries == 0


def test_a_block_left_on_an_error_still_leaves_a_server_that_answers(start_server: StartServer) -> None:
    server = start_server(lease_ttl=LONG_LEASE)
    with pytest.raises(KeyboardInterrupt), Client(server.target, name="interrupted") as worker:
        worker.register({"w": np.zeros(2, np.float32)})
        raise KeyboardInterrupt
    with Client(server.target) as observer:
        assert observer.status().active_workers == 0  # it left: not held until LONG_LEASE
    assert "worker left" in server.log()
