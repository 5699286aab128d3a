from __future__ import annotations

import argparse

import pytest

from gemps_server import config
from gemps_server.config import ServerConfig


def test_defaults_match_the_design() -> None:
    c = config.parse([], environ={})
    assert (c.rule, c.learning_rate, c.momentum, c.kappa, c.pi_max, c.batch_size) == ("gem", 0.05, 0.9, 1.0, 5.0, 64)


def test_flag_beats_environment_beats_default() -> None:
    env = {"GEMPS_LEARNING_RATE": "0.1", "GEMPS_RULE": "downpour", "GEMPS_PORT": "6000"}
    c = config.parse(["--rule", "momentum"], environ=env)
    assert c.rule == "momentum"  # flag
    assert c.learning_rate == 0.1 and c.port == 6000  # environment
    assert c.kappa == 1.0  # default


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="GEMPS_MAX_WORKERS='lots' is not a valid max_workers"):
        config.parse([], environ={"GEMPS_MAX_WORKERS": "lots"})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rule": "sync"}, "unknown rule 'sync'"),
        ({"momentum": 1.0}, "momentum must be in [0, 1)"),
        ({"learning_rate": 0.0}, "learning_rate must be > 0"),
        ({"port": 70000}, "port 70000 outside"),
        ({"lease_ttl": -1.0}, "lease_ttl must be > 0"),
    ],
)
def test_invalid_values_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        ServerConfig(**overrides)  # type: ignore[arg-type]


def test_unknown_choice_on_the_command_line_exits() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rule", "sync"])
