"""A commit rule's own options (gemps_proto.rule_options): declared once by the rule, checked where a
config is checked and where a rule is made, and one flag with one meaning across rules."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
import subprocess
import sys

import pytest

from gemps_proto.ranges import Range
from gemps_proto.rule_options import OptionValues, RuleCatalog, RuleOption
from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules import (
    create_rule,
    register_rule,
    rule_catalog,
    rule_names,
    training_problems,
    unregister_rule,
    with_rule_defaults,
)
from gemps_server.domain.rules.base import Schedule, constant_schedule
from gemps_server.domain.rules.downpour import DownpourRule
from gemps_server.domain.rules.momentum import MOMENTUM
from tests.helpers import training

STEPS = RuleOption("steps", 4, Range(1, 64), "local steps")
#: the built-in rules' options: GEM's, then delayed-nesterov's own (it shares momentum)
BUILT_IN_OPTIONS = [
    *("momentum", "kappa", "pi_max", "dn_learning_rate", "nesterov_period", "momentum_activation"),
    *("adam_beta1", "adam_beta2", "adam_epsilon", "adam_weight_decay", "adam_decay_vectors", "gradient_clip"),
    *("round_size", "backup_workers", "outer_rate", "outer_momentum"),
]


def test_the_built_in_rules_declare_their_options_once() -> None:
    assert [o.name for o in rule_catalog().declared()] == BUILT_IN_OPTIONS
    assert rule_catalog().rules_taking("momentum") == ["gem", "momentum", "nesterov", "delayed-nesterov"]
    assert [rule_catalog().options_of(rule) for rule in ("downpour", "adaptive-staleness")] == [(), ()]
    assert all(rule_catalog().knows(rule) for rule in rule_names())


def test_an_option_the_rule_does_not_take_is_refused_where_the_rule_is_made() -> None:
    with pytest.raises(ValueError, match=re.escape("rule 'downpour' takes no option 'momentum' (it takes none)")):
        create_rule(training("downpour", momentum=0.5), 4)
    with pytest.raises(ValueError, match=re.escape("momentum 1.0 is outside [0, 1)")):
        create_rule(training("momentum", momentum=1.0), 4)
    made = create_rule(training("gem", kappa=2.0), 4)  # the others at their defaults
    assert (made.momentum, made.kappa, made.pi_max) == (0.9, 2.0, 5.0)  # type: ignore[attr-defined]


def test_the_announced_config_carries_every_option_of_its_rule() -> None:
    assert with_rule_defaults(training("gem", kappa=2.0)).rule_options == {
        "momentum": 0.9,
        "kappa": 2.0,
        "pi_max": 5.0,
    }
    assert with_rule_defaults(training("downpour")).rule_options == {}
    assert with_rule_defaults(training("not-a-rule", x=1.0)).rule_options == {"x": 1.0}  # the server's to refuse


def test_as_dict_lists_the_options_by_name_and_from_flat_reads_them_back() -> None:
    config = training("gem", learning_rate=0.1, kappa=2.0)
    flat = config.as_dict()
    assert list(flat)[:3] == ["rule", "learning_rate", "kappa"] and "rule_options" not in flat
    assert TrainingConfig.from_flat(flat) == config


def test_a_configs_options_are_read_only_and_hashable_like_the_config() -> None:
    config = training("gem", kappa=2.0)
    with pytest.raises(TypeError, match="read-only"):
        config.rule_options["kappa"] = 3.0  # type: ignore[index]
    assert hash(config) == hash(training("gem", kappa=2.0)) and isinstance(config.rule_options, OptionValues)
    assert dataclasses.replace(config, rule_options={"kappa": 3.0}).rule_options == {"kappa": 3.0}


def test_an_int_option_takes_whole_numbers() -> None:
    assert STEPS.kind is int and MOMENTUM.kind is float
    assert STEPS.problems(4.0) == [] and STEPS.problems(2.5) == ["steps 2.5 is not a whole number"]
    assert STEPS.problems(0) == ["steps 0 is outside [1, 64]"]


def test_an_option_name_is_one_flag_a_variable_and_a_label() -> None:
    with pytest.raises(ValueError, match="'Steps' is not lowercase words"):
        RuleOption("Steps", 4, Range(1, 64), "")
    with pytest.raises(ValueError, match="'local-steps' is not lowercase words"):
        RuleOption("local-steps", 4, Range(1, 64), "")


def test_one_name_is_one_declaration_across_rules() -> None:
    catalog = RuleCatalog()
    catalog.declare("a", [STEPS, MOMENTUM])
    catalog.declare("b", [STEPS])  # the same declaration: shared
    other = dataclasses.replace(STEPS, default=8)
    with pytest.raises(ValueError, match="rule 'c' declares option 'steps' unlike rule a, b's"):
        catalog.declare("c", [other])
    with pytest.raises(ValueError, match="declares an option twice"):
        catalog.declare("d", [STEPS, STEPS])
    assert catalog.problems("b", {"momentum": 0.5}) == [
        "rule 'b' takes no option 'momentum' (its options: steps; rule a takes it)"
    ]
    catalog.withdraw("a")
    assert catalog.declared() == [STEPS] and not catalog.knows("a")


class LocalRule(DownpourRule):
    name = "local-test"
    options = (STEPS,)

    def __init__(
        self, num_parameters: int, *, learning_rate: float, steps: int, schedule: Schedule = constant_schedule
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        self.steps = steps


class NotTakingIt(DownpourRule):
    name = "not-taking-it-test"
    options = (STEPS,)  # no constructor parameter `steps`


class ClashingRule(LocalRule):
    name = "clashing-test"
    options = (RuleOption("batch_size", 4, Range(1, 64), ""),)


def test_the_registry_refuses_a_rule_it_could_not_make_or_name() -> None:
    register_rule(LocalRule)
    try:
        with pytest.raises(ValueError, match="a commit rule named 'local-test' is registered already"):
            register_rule(LocalRule)
        made = create_rule(training("local-test", steps=3.0), 4)  # from the wire: a double
        assert isinstance(made, LocalRule) and made.steps == 3 and type(made.steps) is int
    finally:
        unregister_rule(LocalRule.name)
    with pytest.raises(ValueError, match="constructor takes no keyword-only steps"):
        register_rule(NotTakingIt)
    with pytest.raises(ValueError, match="names an option like a training config field: batch_size"):
        register_rule(ClashingRule)
    assert {"local-test", "not-taking-it-test", "clashing-test"}.isdisjoint(rule_names())
    assert [o.name for o in rule_catalog().declared()] == BUILT_IN_OPTIONS


def test_a_config_with_rule_options_pickles_and_copies() -> None:
    """Ray pickles a config inside every Status a partition actor returns: a read-only mapping that
    pickle rebuilt item by item could not be unpickled, and `gemps ray` printed no progress."""
    config = TrainingConfig.from_flat({"rule": "gem", "momentum": 0.5})
    for again in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert again == config and again.rule_options == {"momentum": 0.5}
        with pytest.raises(TypeError, match="read-only"):
            again.rule_options["momentum"] = 0.1  # type: ignore[index]


CONFIG_PROBLEMS = """
import json, sys
from gemps_proto.schema import TrainingConfig
if sys.argv[1] == "with-rules":
    import gemps_server.domain.rules  # noqa: F401  (the server's registry, imported or not)
bad = TrainingConfig(learning_rate=0.0, rule_options={"kappa": -1.0, "damping": 2.0})
print(json.dumps(bad.problems()))
"""


def test_a_training_configs_own_check_is_the_same_whatever_the_process_imported() -> None:
    """TrainingConfig.problems answered from a catalog of the process that importing the server's
    rules filled: in an SDK's process it said nothing of the rule's options, in a server's it
    refused them. Now it checks its own fields alike everywhere; the rule's options are the
    registry's to check (training_problems), handed its catalog."""
    said = [
        json.loads(subprocess.run([sys.executable, "-c", CONFIG_PROBLEMS, how], capture_output=True, text=True,
                                  check=True).stdout)
        for how in ("alone", "with-rules")
    ]  # fmt: skip
    assert said[0] == said[1] == ["learning_rate 0.0 is outside (0, 3.4e+38]"], said
    registry = training_problems(TrainingConfig(learning_rate=0.0, rule_options={"kappa": -1.0, "damping": 2.0}))
    assert registry == [
        "learning_rate 0.0 is outside (0, 3.4e+38]",
        "kappa -1.0 is outside (0, 3.4e+38]",
        "rule 'gem' takes no option 'damping' (its options: momentum, kappa, pi_max)",
    ]
