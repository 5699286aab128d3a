"""The Jepsen suite of replicated partitions (scripts/jepsen_replicas.py, gemps_bench.jepsen), cut
to two short trials with fixed seeds: R = 2 on simulated hosts, counting workers committing.

- mixed: the primary's cable pulled, etcd paused, a backup killed and started again, in turn; beside
  it a second job (issue 77, item 1) whose primary is killed and started again, each job's workers'
  replica list ending with the other job's primary: neither job's θ may take the other's commits.
- stale wipe (issue 41, item 4): a backup paused until dropped from the in-sync set, etcd
  restarted empty, the old primary paused past its lease while the stale backup goes on.

Each must end with no acknowledged commit lost, none applied twice, none in another job's θ, no
epoch held by two replicas or given twice, and no worker waiting over 10 s for an acknowledgement
while a replica holding every acknowledged commit (and etcd) was up. Needs root and etcd; skipped with one line without.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from gemps_bench.jepsen.plan import draw
from gemps_bench.jepsen.trial import TrialOptions, run_trial

from gemps_worker.simulated_hosts import unavailable_reason
from tests.etcd_server import require_etcd

ROOT = Path(__file__).resolve().parents[2]
#: seed, episodes, stale-wipe chance, faults on a second job (None: no second job)
TRIALS = {"mixed": (7, 3, 0.0, 1), "stale-wipe": (1, 1, 1.0, None)}
#: the faults those seeds draw, pinned
KINDS = {
    "mixed": ["part:primary", "pause:etcd", "kill:primary@B", "kill:backup"],
    "stale-wipe": ["pause:backup", "wipe:etcd", "pause:primary"],
}


@pytest.mark.parametrize("name", list(TRIALS))
def test_no_acknowledged_commit_is_lost_and_no_epoch_is_held_twice(name: str, tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    require_etcd()
    seed, episodes, stale_wipe, second_job = TRIALS[name]
    plan = draw(seed, episodes=episodes, stale_wipe=stale_wipe, second_job=second_job)
    assert plan.kinds() == KINDS[name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    trial = run_trial(plan, tmp_path, TrialOptions(), env)
    summary = json.dumps({k: trial[k] for k in ("faults", "settled_after_heal_s", "resumed_after_heal_s")})
    verdicts = [trial["verdict"], *([trial["second_job"]["verdict"]] if second_job is not None else [])]
    print(f"{name}: {json.dumps(verdicts)}\n{summary}")
    assert all(fault["host"] for fault in trial["faults"]), summary  # every fault found its host
    for verdict in verdicts:
        assert_exactly_once(verdict)


def assert_exactly_once(verdict: dict[str, Any]) -> None:
    """One job's verdict: every acknowledged commit in its θ once, nothing in it from elsewhere."""
    assert verdict["acknowledged"] > 0
    assert (verdict["lost"], verdict["applied_twice"]) == (0, 0), verdict
    assert (verdict["wrong_theta"], verdict["acknowledged_elsewhere"]) == (0, 0), verdict
    assert verdict["theta_counts_commits"], verdict
    epochs = verdict["epochs"]
    assert not epochs["two_primaries"] and not epochs["stale_acks"], epochs  # one primary per epoch
    assert not epochs["reused"], epochs
    assert verdict["wedged"] == [], verdict["wedged"]
