"""`gemps server` configured by environment, as containers and Kubernetes do (issue 49, item 5).

The issue's command, `GEMPS_LERNING_RATE=0.5 GEMPS_RULES=downpour gemps server`, trained GEM at
eta 0.05 without a word. A real server process: it warns of each misspelling, naming the option
meant, and logs what it runs with and where each value came from, the token hidden; with
GEMPS_STRICT_ENV=1 it does not start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import server_outcome

pytestmark = pytest.mark.timeout(300)

QUIET = ("--port", "0", "--data-port", "0", "--metrics-port", "-1")
TOKEN = "s3cret-token-49"


def records(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_the_issues_misspellings_are_warned_of_and_the_configuration_says_what_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEMPS_LERNING_RATE", "0.5")
    monkeypatch.setenv("GEMPS_RULES", "downpour")
    monkeypatch.setenv("GEMPS_MOMENTUM", "0.5")  # spelled right: it counts
    monkeypatch.setenv("GEMPS_AUTH_TOKEN", TOKEN)
    code, lines = server_outcome(tmp_path, *QUIET, "--log-format", "json")
    assert code is None, lines  # warned, not refused
    logged = records(lines)
    warnings = [r["message"] for r in logged if r["level"] == "warning" and r["logger"] == "gemps.config"]
    assert warnings == [
        "GEMPS_LERNING_RATE is not a gemps option (did you mean GEMPS_LEARNING_RATE?); it is ignored",
        "GEMPS_RULES is not a gemps option (did you mean GEMPS_RULE?); it is ignored",
    ], lines
    (configuration,) = [r for r in logged if r.get("event") == "configuration"]
    assert (configuration["rule"], configuration["learning_rate"], configuration["momentum"]) == ("gem", 0.05, 0.5)
    assert {"momentum", "auth_token"} <= set(configuration["from_environment"].split(",")), configuration
    assert set(configuration["from_flags"].split(",")) == {
        "port",
        "data_port",
        "metrics_port",
        "log_format",
        "port_file",
    }
    assert configuration["auth_token"] == "<redacted>"
    assert not [line for line in lines if TOKEN in line]


def test_with_strict_env_a_misspelling_stops_the_server_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEMPS_LERNING_RATE", "0.5")
    monkeypatch.setenv("GEMPS_STRICT_ENV", "1")
    code, lines = server_outcome(tmp_path, *QUIET)
    assert code == 2, lines
    assert lines == [
        "gemps server: GEMPS_LERNING_RATE is not a gemps option (did you mean GEMPS_LEARNING_RATE?); "
        "strict: unknown variables are errors"
    ], lines
