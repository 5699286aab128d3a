"""GEMPS_* variables that configure nothing are said, not ignored (issue 49, item 5).

`GEMPS_LERNING_RATE=0.5 GEMPS_RULES=downpour gemps server` trained GEM at eta 0.05 without a word.
Now every command that reads GEMPS_* options warns of a variable that is no option of any gemps
command (nor one read elsewhere), naming the closest; --strict-env or GEMPS_STRICT_ENV=1 makes it
an error, exit 2, before anything starts. The server's configuration line says where each value
came from and never prints the token.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from gemps_cli import environment
from gemps_cli import server as server_command
from gemps_cli.main import main

from gemps import options
from gemps.options import UnknownVariable
from gemps_server.config import ServerConfig
from gemps_server.config_log import REDACTED, log_configuration
from gemps_server.domain.rules import rule_catalog

ROOT = Path(__file__).resolve().parents[2]
# Misspellings the docs and tests use on purpose (the issue's).
DELIBERATE_MISSPELLINGS = {"GEMPS_LERNING_RATE", "GEMPS_RULES"}
ISSUE_ENVIRONMENT = {"GEMPS_LERNING_RATE": "0.5", "GEMPS_RULES": "downpour", "HOME": "/root"}


def strict(value: bool | None = None) -> argparse.Namespace:
    return argparse.Namespace(strict_env=value)


def test_the_issues_misspellings_name_the_options_they_meant() -> None:
    unknown = options.unknown_variables(ISSUE_ENVIRONMENT, environment.known_options(), environment.NOT_OPTIONS)
    assert unknown == [
        UnknownVariable("GEMPS_LERNING_RATE", "GEMPS_LEARNING_RATE"),
        UnknownVariable("GEMPS_RULES", "GEMPS_RULE"),
    ]
    assert str(unknown[0]) == "GEMPS_LERNING_RATE is not a gemps option (did you mean GEMPS_LEARNING_RATE?)"
    assert options.unknown_variables({"GEMPS_XYZZY": "1"}, environment.known_options()) == [
        UnknownVariable("GEMPS_XYZZY", None)
    ]


def test_an_unknown_variable_is_a_warning_that_names_the_closest_option(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gemps.config"):
        assert environment.screen("server", strict(), ISSUE_ENVIRONMENT)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "GEMPS_LERNING_RATE" in warnings[0] and "did you mean GEMPS_LEARNING_RATE?" in warnings[0]
    assert "GEMPS_RULES" in warnings[1] and "did you mean GEMPS_RULE?" in warnings[1]


@pytest.mark.parametrize(
    ("args", "environ"),
    [(strict(True), ISSUE_ENVIRONMENT), (strict(), {**ISSUE_ENVIRONMENT, environment.STRICT_VARIABLE: "1"})],
    ids=["--strict-env", "GEMPS_STRICT_ENV=1"],
)
def test_strict_makes_it_an_error_naming_each_variable(
    args: argparse.Namespace, environ: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert not environment.screen("server", args, environ)
    error = capsys.readouterr().err
    assert error.startswith("gemps server: GEMPS_LERNING_RATE is not a gemps option"), error
    assert "GEMPS_LEARNING_RATE" in error and "GEMPS_RULES" in error and "GEMPS_RULE?" in error, error


def test_a_strict_setting_that_is_no_boolean_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert not environment.screen("worker", strict(), {environment.STRICT_VARIABLE: "sometimes"})
    assert "GEMPS_STRICT_ENV: not a boolean: 'sometimes'" in capsys.readouterr().err


def test_known_variables_never_warn_even_when_strict(caplog: pytest.LogCaptureFixture) -> None:
    everything = {name: "x" for name in environment.known_options() | set(environment.NOT_OPTIONS)}
    with caplog.at_level(logging.WARNING, logger="gemps.config"):
        assert environment.screen("server", strict(True), everything)
    assert not caplog.records


def test_every_commands_options_are_known() -> None:
    """TRAINING_OPTIONS is written out (`gemps server` must not import torch): it holds exactly
    the options of the commands that train that the server lacks."""
    pytest.importorskip("torch")
    pytest.importorskip("ray")
    from gemps_worker.demo import DemoOptions
    from gemps_worker.evaluation_loop import EvaluatorOptions
    from gemps_worker.on_ray.options import RayJobOptions
    from gemps_worker.supervisor import SupervisorOptions
    from gemps_worker.training import WorkerOptions

    def names(kind: type[Any]) -> set[str]:
        return {options.env_var(f.name) for f in options.options_of(kind, rule_catalog().fields)}

    server = names(ServerConfig)
    training = set[str]().union(
        *(names(kind) for kind in (WorkerOptions, SupervisorOptions, EvaluatorOptions, DemoOptions, RayJobOptions))
    )
    assert set(environment.TRAINING_OPTIONS) == training - server
    assert not set(environment.NOT_OPTIONS) & (training | server)


def _mentioned() -> dict[str, set[str]]:
    """GEMPS_* names the deployment files, docs, Makefile and code read or set, by name -> files."""
    texts = [ROOT / "docker-compose.yml", ROOT / "Makefile", ROOT / "README.md"]
    texts += [*ROOT.glob("deploy/**/*"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("tools/*")]
    found: dict[str, set[str]] = {}
    for path in texts:
        if path.is_file() and "__pycache__" not in path.parts:  # `make test` byte-compiles deploy/'s Python
            for name in re.findall(r"\bGEMPS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    # In code the names in quotes: a constant such as GEMPS_COMMAND is not a variable.
    for folder in ("client_sdk", "server", "worker", "cli", "benchmarks", "scripts", "tests", "deploy"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != Path(__file__).resolve():  # this file's misspellings are on purpose
                for name in re.findall(r"""["'](GEMPS_[A-Z0-9_]*[A-Z0-9])["']""", path.read_text()):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_no_variable_the_repository_uses_is_unknown() -> None:
    """Every GEMPS_* name the compose files, manifests, docs and code use is an option or on the
    list of variables read elsewhere, so none of them warns."""
    mentioned = _mentioned()
    assert {"GEMPS_PLANE", "GEMPS_TLS_CA", "GEMPS_HOST_PORT", "GEMPS_REQUIRE_ETCD", "GEMPS_EPOCHS"} <= set(mentioned)
    known = environment.known_options() | set(environment.NOT_OPTIONS) | DELIBERATE_MISSPELLINGS
    assert {name: sorted(files) for name, files in mentioned.items() if name not in known} == {}


@pytest.mark.parametrize("command", ["worker", "evaluate", "demo", "ray"])
def test_the_commands_that_train_refuse_an_unknown_variable_when_strict(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    if command == "ray":
        pytest.importorskip("ray")
    monkeypatch.setenv("GEMPS_EPOCS", "3")
    assert main([command, "--strict-env"]) == 2  # before it reaches for a server
    assert "GEMPS_EPOCS is not a gemps option (did you mean GEMPS_EPOCHS?)" in capsys.readouterr().err


def test_origins_say_where_each_value_came_from() -> None:
    parser = argparse.ArgumentParser()
    server_command.add_arguments(parser)
    args = parser.parse_args(["--port", "6000"])
    environ = {"GEMPS_RULE": "downpour", "GEMPS_PORT": "7000"}
    found = options.origins(ServerConfig, args, environ, rule_catalog().fields)
    assert (found["port"], found["rule"], found["learning_rate"]) == ("flag", "environment", "default")
    assert set(found) == {f.name for f in options.options_of(ServerConfig, rule_catalog().fields)}
    config = options.from_sources(ServerConfig, args, environ, rule_catalog().fields)  # the same precedence
    assert (config.port, config.training.rule) == (6000, "downpour")


def test_the_configuration_line_says_where_values_came_from_and_hides_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = server_command.parse_config(["--port", "6000"], environ={"GEMPS_AUTH_TOKEN": "s3cret", "GEMPS_KAPPA": "2"})
    origins = {"port": "flag", "auth_token": "environment", "kappa": "environment", "rule": "default"}
    with caplog.at_level(logging.INFO, logger="gemps.server"):
        log_configuration(config, origins)
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("configuration from_flags=port from_environment=auth_token,kappa "), line
    fields = line.split(" ")
    assert {"port=6000", "kappa=2", "learning_rate=0.05", "rule=gem"} <= set(fields), line
    assert f"auth_token={REDACTED}" in line and "s3cret" not in line, line
