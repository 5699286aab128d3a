"""Commit rules, one per module, looked up by name."""

from __future__ import annotations

from gemps_server.rules.adaptive_staleness import AdaptiveStalenessRule
from gemps_server.rules.base import ApplyStats, CommitRule, RuleParams
from gemps_server.rules.downpour import DownpourRule
from gemps_server.rules.gem import GemRule
from gemps_server.rules.momentum import MomentumRule

_RULES: dict[str, type[CommitRule]] = {
    rule.name: rule for rule in (GemRule, DownpourRule, AdaptiveStalenessRule, MomentumRule)
}


def rule_names() -> list[str]:
    return list(_RULES)


def create_rule(name: str, params: RuleParams, num_parameters: int) -> CommitRule:
    try:
        rule_class = _RULES[name]
    except KeyError:
        raise ValueError(f"unknown commit rule {name!r}; valid rules: {', '.join(_RULES)}") from None
    return rule_class(params, num_parameters)


__all__ = ["ApplyStats", "CommitRule", "RuleParams", "create_rule", "rule_names"]
