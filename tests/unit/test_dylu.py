"""Dynamic local updates (DyLU; Liu et al. 2024): H_i = floor(v_i / v_max · H) from the speeds the
server's Status reports, and the worker options refused before anything registers."""

from __future__ import annotations

import logging

import pytest
from gemps_cli.main import main as gemps_main

from gemps_proto.schema import TrainingConfig
from gemps_proto.status import RecentCommits, ServerStatus, WorkerStatus
from gemps_worker.modes import dynamic_local_steps, worker_speeds
from gemps_worker.training import WorkerOptions, run_worker


@pytest.mark.parametrize(
    ("speed", "fastest", "steps"),
    [(100.0, 100.0, 10), (50.0, 100.0, 5), (59.0, 100.0, 5), (9.0, 100.0, 1), (0.5, 100.0, 1), (101.0, 100.0, 10)],
)
def test_local_steps_are_the_floor_of_the_speed_ratio_times_h_and_at_least_one(
    speed: float, fastest: float, steps: int
) -> None:
    assert dynamic_local_steps(10, speed, fastest) == steps


def worker(shard: int, samples: int, seconds: float) -> WorkerStatus:
    recent = RecentCommits(seconds=seconds, commits=1 if samples else 0, samples=samples)
    return WorkerStatus(f"w{shard}", shard, 1, 0.0, 0.0, recent)


def test_speeds_are_samples_a_second_of_training_of_the_workers_whose_commits_reported_samples() -> None:
    workers = (worker(0, 640, 10.0), worker(1, 0, 10.0), worker(2, 320, 8.0), worker(3, 64, 0.0))
    status = ServerStatus(True, 1, 4, 16, TrainingConfig(), 4, 0, (), 10.0, None, workers=workers)
    assert worker_speeds(status) == {0: 64.0, 2: 40.0}
    # Less each commit's round trip: 10 s less one commit of 2 s, 8 s less one of 2 s.
    assert worker_speeds(status, round_trip=2.0) == {0: 80.0, 2: 320 / 6}
    # A span all round trips says nothing of the worker's speed.
    assert worker_speeds(status, round_trip=10.0) == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "dylu", "dylu_steps": 0}, "dylu_steps 0 is outside [1, "),
        ({"mode": "dynsgd", "dynsgd_steps": -2}, "dynsgd_steps -2 is outside [1, "),
        ({"mode": "agn", "agn_steps": 0}, "agn_steps 0 is outside [1, "),
        ({"batch_delay": -1.0}, "batch_delay -1.0 is outside [0, "),
    ],
)
def test_bad_local_steps_are_refused_before_registering(options: dict[str, object], message: str) -> None:
    # No server listens at port 1: a worker that got as far as registering would fail otherwise.
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        run_worker(WorkerOptions(server="127.0.0.1:1", patience=0.1, **options))  # type: ignore[arg-type]


def test_gemps_worker_names_the_bad_option_and_exits_2(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="gemps.worker"):
        code = gemps_main(["worker", "--server", "127.0.0.1:1", "--mode", "dylu", "--dylu-steps", "0"])
    assert code == 2
    assert "dylu_steps 0 is outside [1, 2147483647]" in caplog.text
