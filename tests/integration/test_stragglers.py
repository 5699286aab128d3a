"""Issue 50, item 5: a straggler GEM damps shows, against a real server with three workers.

Before, Status gave each worker only its commits, rate and staleness, and /metrics had no
per-worker view: an operator could not see GEM scale one worker's commits to π ≈ 0. Now Status
carries each worker's mean π and clamped fractions over the last minute, `gemps status` names the
most-damped and slowest workers, and /metrics exports the top of both rankings.
"""

from __future__ import annotations

import re

import pytest
from gemps_cli.main import main as gemps_main

from gemps import Client
from tests.helpers import scrape_series
from tests.integration.conftest import StartServer
from tests.straggler_fleet import FAST, SLOW, StragglerFleet

pytestmark = pytest.mark.timeout(120)

SLOW_COMMITS = 8  # about 1.6 s of the straggler's pauses


def test_gemps_status_names_the_slowed_worker_damped(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(rule="gem")
    with StragglerFleet(server.target) as fleet:
        fleet.wait(SLOW_COMMITS)
        with Client(server.target) as observer:
            workers = {worker.name: worker.recent for worker in observer.status().workers}
        assert gemps_main(["status", "--server", server.target]) == 0
        page = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    shown = capsys.readouterr().out
    slow = workers[SLOW]
    for name in FAST:  # each fast worker commits between two of the straggler's, and far more often
        fast = workers[name]
        assert slow.staleness > 5 * fast.staleness and slow.rate < fast.rate / 5, workers
        assert slow.scaling_mean < fast.scaling_mean / 3 and slow.scaling_at_zero > fast.scaling_at_zero, workers
    assert slow.scaling_mean < 0.5 and slow.scaling_at_zero > 0.6, slow  # GEM drops most of its update
    # The stragglers' lines name it first, with its π and staleness; its own line says the same.
    damped = re.search(
        r"^most damped     (\S+) π ([\d.]+) \((\d+)% at 0, \d+% at max\), staleness ([\d.]+);", shown, re.M
    )
    assert damped is not None, shown
    assert damped[1] == SLOW and float(damped[2]) < 0.5 and int(damped[3]) > 60 and float(damped[4]) > 10, shown
    assert re.search(rf"^slowest         {SLOW} [\d.]+/s; ", shown, re.M), shown
    row = re.search(rf"^  shard \d +{SLOW} +.* staleness ([\d.]+), π ([\d.]+) \(\d+% at 0", shown, re.M)
    assert row is not None and float(row[2]) < 0.5, shown
    # /metrics: rank 1 of both rankings is the straggler; at most 5 series a family.
    assert page[f'gemps_damped_worker_scaling{{rank="1",worker="{SLOW}"}}'] < 0.5, page
    assert page[f'gemps_damped_worker_staleness{{rank="1",worker="{SLOW}"}}'] > 10
    assert f'gemps_slowest_worker_commits_per_second{{rank="1",worker="{SLOW}"}}' in page
    ranked = [series for series in page if series.startswith("gemps_damped_worker_scaling{")]
    assert len(ranked) == 3, ranked
