from __future__ import annotations

import argparse
import re

import pytest
from gemps_cli import server

from tests.helpers import server_config


def test_defaults_match_the_design() -> None:
    t = server.parse_config([], environ={}).training
    assert (t.rule, t.learning_rate, t.momentum, t.kappa, t.pi_max, t.batch_size) == ("gem", 0.05, 0.9, 1.0, 5.0, 64)


def test_flag_beats_environment_beats_default() -> None:
    env = {"GEMPS_LEARNING_RATE": "0.1", "GEMPS_RULE": "downpour", "GEMPS_PORT": "6000"}
    c = server.parse_config(["--rule", "momentum"], environ=env)
    assert c.training.rule == "momentum"  # flag
    assert c.training.learning_rate == 0.1 and c.port == 6000  # environment
    assert c.training.kappa == 1.0  # default


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="GEMPS_MAX_WORKERS='lots' is not a valid max_workers"):
        server.parse_config([], environ={"GEMPS_MAX_WORKERS": "lots"})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rule": "sync"}, "unknown rule 'sync'"),
        ({"momentum": 1.0}, "momentum 1.0 is outside [0, 1)"),
        ({"learning_rate": 0.0}, "learning_rate 0.0 is outside (0, "),
        ({"port": 70000}, "port 70000 is outside [0, 65535]"),
        ({"lease_ttl": -1.0}, "lease_ttl -1.0 is outside (0, "),
    ],
)
def test_invalid_values_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        server_config(**overrides)


def test_unknown_choice_on_the_command_line_exits() -> None:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rule", "sync"])


def test_compiled_kernel_asked_for_where_it_was_not_built_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gemps_server.config.training

    monkeypatch.setattr(gemps_server.config.training, "compiled", None)  # as on a machine without a C compiler
    with pytest.raises(ValueError, match="gem_kernel 'compiled' is not built here"):
        server_config(gem_kernel="compiled")
    assert server_config(gem_kernel="auto").gem_kernel == "auto"  # auto falls back to numpy instead
