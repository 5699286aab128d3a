"""gemps_bench.overlap's parts that run without root: a step's compute timed alone (what the bench
sets the round trip against); the bench itself needs simulated hosts and quotas (as root) and its
results are recorded in docs/results/overlap.json."""

from __future__ import annotations

import json

import pytest
from gemps_bench import overlap


def test_a_steps_compute_is_timed_and_printed_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert overlap.main(["--time-compute", "--batch", "8"]) == 0
    found = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(found) == {"compute_s"} and 0 < found["compute_s"] < 10
