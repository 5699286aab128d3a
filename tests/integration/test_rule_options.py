"""A rule with options of its own, registered in this test alone (issue 57, item 4): each option is
a flag and a GEMPS_* variable, refused for another rule, the server takes and announces it, and
`gemps status`, the info metric and checkpoints show it, though no .proto field and no line of the
checkpoint code names it: the rule's declaration is all it took."""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gemps_cli import server as server_command
from gemps_cli.main import main as gemps_main

import gemps
from gemps.options import env_var
from gemps_proto.ranges import Range
from gemps_proto.rule_options import RuleOption
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import load_latest
from gemps_server.domain.rules import register_rule, rule_catalog, rule_names, unregister_rule
from gemps_server.domain.rules.base import Schedule, constant_schedule
from gemps_server.domain.rules.downpour import DownpourRule
from tests.helpers import scrape_series
from tests.integration.conftest import StartServer

P = 4
# The rule's variable, known while it is registered: a name the repository's scan of variables
# (tests/unit/test_env_options.py) would find unknown, written out.
UNDAMPED_VARIABLE = env_var("undamped")


class DampedRule(DownpourRule):
    """downpour with the learning rate times `damping` from central version `undamped` on."""

    name = "damped-test"
    options = (
        RuleOption("damping", 0.5, Range(0, 1, low_open=True), "the factor eta is multiplied by"),
        RuleOption("undamped", 0, Range(0, 100, unit="versions"), "versions before the damping starts"),
    )

    def __init__(
        self,
        num_parameters: int,
        *,
        learning_rate: float,
        damping: float,
        undamped: int,
        schedule: Schedule = constant_schedule,
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        self.damping, self.undamped = damping, undamped

    def learning_rate_at(self, version: int) -> float:
        return super().learning_rate_at(version) * (1.0 if version < self.undamped else self.damping)


@pytest.fixture
def damped() -> Iterator[type[DampedRule]]:
    register_rule(DampedRule)
    yield DampedRule
    unregister_rule(DampedRule.name)
    assert DampedRule.name not in rule_names() and not rule_catalog().knows(DampedRule.name)


def test_each_option_is_a_flag_and_a_variable_of_its_own(damped: type[DampedRule]) -> None:
    parser = argparse.ArgumentParser(prog="gemps server")
    server_command.add_arguments(parser)
    flags = {flag: action for action in parser._actions for flag in action.option_strings}
    assert flags["--damping"].help == (
        "the factor eta is multiplied by; rule damped-test (env GEMPS_DAMPING; default 0.5; range (0, 1])"
    )
    assert flags["--undamped"].type is int and flags["--damping"].type is float
    assert "damped-test" in (flags["--rule"].choices or ())
    assert "--undamped UNDAMPED" in parser.format_help()
    argv = ["--rule", "damped-test", "--damping", "0.25"]
    config = server_command.parse_config(argv, environ={UNDAMPED_VARIABLE: "2"})
    assert config.training.rule_options == {"damping": 0.25, "undamped": 2}
    assert type(config.training.rule_options["undamped"]) is int
    # What it leaves unset takes its declared default.
    assert server_command.parse_config(["--rule", "damped-test"], environ={}).training.rule_options == {
        "damping": 0.5,
        "undamped": 0,
    }


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--damping", "0.25"], {}, "rule 'gem' takes no option 'damping' (its options: momentum, kappa, pi_max; "),
        (["--rule", "downpour"], {UNDAMPED_VARIABLE: "3"}, "rule 'downpour' takes no option 'undamped' (it takes none"),
        (["--rule", "damped-test", "--kappa", "2"], {}, "rule 'damped-test' takes no option 'kappa'"),
        (["--rule", "damped-test", "--damping", "1.5"], {}, "damping 1.5 is outside (0, 1]"),
    ],
)
def test_an_option_the_rule_does_not_take_or_out_of_its_range_is_refused(
    damped: type[DampedRule], argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        server_command.parse_config(argv, environ=environ)


def test_a_toy_option_travels_to_workers_status_metrics_and_checkpoints(
    damped: type[DampedRule], start_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert {"damping", "undamped"}.isdisjoint(pb.TrainingConfig.DESCRIPTOR.fields_by_name)  # no field of its own
    options = {"rule": "damped-test", "damping": 0.25, "undamped": 1, "checkpoint_dir": str(tmp_path)}
    server = start_server(**options)
    with gemps.Client(server.target) as client:
        registration = client.register({"w": np.zeros(P, np.float32)})
        assert registration.config.rule_options == {"damping": 0.25, "undamped": 1}
        for _ in range(3):  # at versions 0 (undamped), 1 and 2 (eta 0.05 * 0.25)
            reply = client.commit(np.ones(P, np.float32))
        np.testing.assert_allclose(reply.parameters.flat, np.full(P, -0.05 - 2 * 0.05 * 0.25), rtol=1e-6)
        assert client.status().config.rule_options == {"damping": 0.25, "undamped": 1}
    assert gemps_main(["status", "--server", server.target]) == 0
    shown = capsys.readouterr().out
    # The rule's line ends with its options now: the schedule's settings are on the learning rate's (issue 60).
    assert "rule            damped-test (learning_rate=0.05 damping=0.25 undamped=1)\n" in shown, shown
    info = [s for s in scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics") if "gemps_server_info{" in s]
    assert len(info) == 1 and 'damping="0.25"' in info[0] and 'undamped="1"' in info[0], info
    server.stop()
    found = load_latest(tmp_path)
    assert found is not None and found[1].version == 3
    recorded = found[1].config
    assert (recorded["rule"], recorded["damping"], recorded["undamped"]) == ("damped-test", 0.25, 1)


def test_a_checkpoint_restores_under_the_same_options_and_names_a_changed_one(
    damped: type[DampedRule], start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"rule": "damped-test", "damping": 0.25, "checkpoint_dir": str(tmp_path)}
    first = start_server(**options)
    with gemps.Client(first.target) as client:
        client.register({"w": np.zeros(P, np.float32)})
        client.commit(np.ones(P, np.float32))
    first.stop()
    with caplog.at_level(logging.WARNING, logger="gemps.server"):
        start_server(**options).stop()
        assert "training config differs" not in caplog.text
        start_server(**{**options, "damping": 0.5}).stop()
    assert "training config differs from the checkpoint's" in caplog.text and "damping" in caplog.text
