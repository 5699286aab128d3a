"""Issue 37, item 4: workers that end without close(), against real servers.

PyTorch's examples never call close(): such a worker stayed "active" in `gemps status` until its
lease expired (60 s by default). `gemps status` says when each worker was last seen.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from gemps_cli.main import main as gemps_main

from gemps import Client
from tests.helpers import InProcessServer

pytestmark = pytest.mark.timeout(120)


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
    rows = re.findall(
        r"^  shard (\d)    (\w+) +last seen [\d.]+s ago, last commit [\d.]+s ago, (\d) commits$", shown, re.M
    )
    assert rows == [("1", "quiet", "0"), ("0", "busy", "1")]
    assert [(w.name, w.shard, w.commits) for w in statuses.workers] == [("busy", 0, 1), ("quiet", 1, 0)]
    assert statuses.lease_ttl_seconds == 60.0
    assert all(0 <= w.seconds_since_seen <= w.seconds_since_commit for w in statuses.workers)
