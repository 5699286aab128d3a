"""Commit rules, one per module, looked up by name (the server's public strategy API).

A rule subclasses CommitRule, names itself (`name`), declares its own options (`options`: each a
gemps_proto.rule_options.RuleOption and a keyword-only constructor parameter of its name) and is
registered: the built-in ones below, another with `register_rule`. The registered rules make the
catalog of options (`rule_catalog`) that the flags (`--NAME`, `GEMPS_NAME`), the checks of a
training config's options (`training_problems`) and the announced defaults (`with_rule_defaults`)
read. Every rule also takes the learning rate and
`schedule`, eta's factor over central versions, which `from_config` builds from the config's lr_*
fields (gemps_proto.schedules); a constructor that overrides CommitRule's passes it on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, ClassVar

from gemps_proto.rule_options import RuleCatalog
from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules.adamw import AdamWRule
from gemps_server.domain.rules.adaptive_staleness import AdaptiveStalenessRule
from gemps_server.domain.rules.base import ApplyStats, CommitRule, NonFiniteUpdate, StepContext
from gemps_server.domain.rules.delayed_nesterov import DelayedNesterovRule
from gemps_server.domain.rules.downpour import DownpourRule
from gemps_server.domain.rules.gem import GemRule
from gemps_server.domain.rules.gem_base import GEM_STATES
from gemps_server.domain.rules.momentum import MomentumRule, NesterovRule

_RULES: dict[str, type[CommitRule]] = {}
_CATALOG = RuleCatalog()  # the options of the rules in _RULES, entered and withdrawn with them
# What a rule option may not be called: the training config's own fields (one flag, one key each).
_RESERVED = frozenset(f.name for f in fields(TrainingConfig))


def register_rule(rule: type[CommitRule]) -> None:
    """Make `rule` one the server runs (`--rule NAME`), with its options as flags of their own;
    ValueError when its name is taken, or an option is named like a training config field or like
    another rule's option but declared otherwise, or is no keyword-only constructor parameter."""
    if rule.name in _RULES:
        raise ValueError(f"a commit rule named {rule.name!r} is registered already")
    clashing = sorted(_RESERVED & {option.name for option in rule.options})
    if clashing:
        raise ValueError(f"rule {rule.name!r} names an option like a training config field: {', '.join(clashing)}")
    missing = rule.undeclared_options()
    if missing:
        raise ValueError(f"rule {rule.name!r}'s constructor takes no keyword-only {', '.join(missing)}")
    _CATALOG.declare(rule.name, rule.options)
    _RULES[rule.name] = rule


def unregister_rule(name: str) -> None:
    """Forget the rule `name` and its options (a rule registered for a while, as a test's)."""
    _RULES.pop(name, None)
    _CATALOG.withdraw(name)


for _rule in (
    GemRule,
    DownpourRule,
    AdaptiveStalenessRule,
    MomentumRule,
    NesterovRule,
    DelayedNesterovRule,
    AdamWRule,
):
    register_rule(_rule)


def rule_names() -> list[str]:
    return list(_RULES)


def rule_catalog() -> RuleCatalog:
    """The options of the registered rules (gemps.options makes flags of its `fields`)."""
    return _CATALOG


def training_problems(config: TrainingConfig) -> list[str]:
    """What is wrong with `config` for the server: an unknown rule, its own fields' problems, and
    its options as its rule takes them (an option it does not take, a value out of range), then
    those set that the rule would leave unused (CommitRule.idle_options)."""
    found = []
    if config.rule not in _RULES:
        found.append(f"unknown rule {config.rule!r} (choose from {', '.join(_RULES)})")
    found += config.problems() + _CATALOG.problems(config.rule, config.rule_options)
    if found or config.rule not in _RULES:
        return found
    return _RULES[config.rule].idle_options(config.rule_options)  # of options in range, as set


def with_rule_defaults(config: TrainingConfig) -> TrainingConfig:
    """`config` with every option of its rule, those not set at their defaults (as announced)."""
    return replace(config, rule_options=_CATALOG.resolved(config.rule, config.rule_options))


def rule_class(name: str) -> type[CommitRule]:
    """The rule called `name`; ValueError listing the valid names otherwise."""
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"unknown commit rule {name!r}; valid rules: {', '.join(_RULES)}") from None


def create_rule(config: TrainingConfig, num_parameters: int, **settings: Any) -> CommitRule:
    """`config.rule`'s rule with its options, in the form and with the run options the server's
    `settings` give it (by the server's option names, e.g. gem_kernel: CommitRule.form,
    run_options; none: the rule's defaults)."""
    return RuleRuntime(**settings).create(config, num_parameters)


class RuleRuntime:
    """How the server runs its rule, not what it computes: the server's settings by name (its
    options: e.g. GEM's gem_kernel, gem_own_step, gem_state), of which each rule reads its own
    (CommitRule.form, CommitRule.run_options)."""

    DEFAULT: ClassVar[RuleRuntime]

    def __init__(self, **settings: Any) -> None:
        self.settings: Mapping[str, Any] = dict(settings)

    def form(self, name: str) -> type[CommitRule]:
        """The class that runs the rule `name` under these settings."""
        return rule_class(name).form(self.settings)

    def create(self, config: TrainingConfig, num_parameters: int) -> CommitRule:
        form = self.form(config.rule)
        return form.from_config(config, num_parameters, **form.run_options(self.settings))


# A ServerState made without the server's settings (tests, tools) runs GEM's numpy kernel: the
# reference the compiled passes are held to.
RuleRuntime.DEFAULT = RuleRuntime(gem_kernel="numpy")


__all__ = [
    "GEM_STATES",
    "ApplyStats",
    "CommitRule",
    "NonFiniteUpdate",
    "RuleRuntime",
    "StepContext",
    "create_rule",
    "register_rule",
    "rule_catalog",
    "rule_class",
    "rule_names",
    "training_problems",
    "unregister_rule",
    "with_rule_defaults",
]
