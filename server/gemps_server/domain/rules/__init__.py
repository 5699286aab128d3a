"""Commit rules, one per module, looked up by name (the server's public strategy API).

A rule subclasses CommitRule, names itself (`name`), takes its hyperparameters as keyword-only
constructor parameters named like TrainingConfig fields, and is listed in `_RULES` below. Every
rule also takes `schedule`, eta's factor over central versions, which `from_config` builds from
the config's lr_* fields (gemps_proto.schedules); a constructor that overrides CommitRule's
passes it on.
"""

from __future__ import annotations

from typing import Any

from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules.adaptive_staleness import AdaptiveStalenessRule
from gemps_server.domain.rules.base import ApplyStats, CommitRule, NonFiniteUpdate
from gemps_server.domain.rules.downpour import DownpourRule
from gemps_server.domain.rules.gem import GemRule
from gemps_server.domain.rules.momentum import MomentumRule

_RULES: dict[str, type[CommitRule]] = {
    rule.name: rule for rule in (GemRule, DownpourRule, AdaptiveStalenessRule, MomentumRule)
}


def rule_names() -> list[str]:
    return list(_RULES)


def rule_class(name: str) -> type[CommitRule]:
    """The rule called `name`; ValueError listing the valid names otherwise."""
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"unknown commit rule {name!r}; valid rules: {', '.join(_RULES)}") from None


def create_rule(config: TrainingConfig, num_parameters: int, **options: Any) -> CommitRule:
    """`config.rule`'s rule with its hyperparameters; `options` (e.g. `kernel`) go to rules that take them."""
    return rule_class(config.rule).from_config(config, num_parameters, **options)


__all__ = ["ApplyStats", "CommitRule", "NonFiniteUpdate", "create_rule", "rule_class", "rule_names"]
