"""Commit rules, one per module, looked up by name (the server's public strategy API).

A rule subclasses CommitRule, names itself (`name`), takes its hyperparameters as keyword-only
constructor parameters named like TrainingConfig fields, and is listed in `_RULES` below. Every
rule also takes `schedule`, eta's factor over central versions, which `from_config` builds from
the config's lr_* fields (gemps_proto.schedules); a constructor that overrides CommitRule's
passes it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules.adaptive_staleness import AdaptiveStalenessRule
from gemps_server.domain.rules.base import ApplyStats, CommitRule, NonFiniteUpdate
from gemps_server.domain.rules.downpour import DownpourRule
from gemps_server.domain.rules.gem import GemRule
from gemps_server.domain.rules.gem_compact import CompactGemRule
from gemps_server.domain.rules.momentum import MomentumRule, NesterovRule

_RULES: dict[str, type[CommitRule]] = {
    rule.name: rule for rule in (GemRule, DownpourRule, AdaptiveStalenessRule, MomentumRule, NesterovRule)
}


def rule_names() -> list[str]:
    return list(_RULES)


#: how GEM keeps each worker's m_i and s_i: exact (float32, gem.py) or compact (8-bit codes, gem_compact.py)
GEM_STATES = ("exact", "compact")


def rule_class(name: str, gem_state: str = "exact") -> type[CommitRule]:
    """The rule called `name` (GEM's in the form `gem_state` names); ValueError listing the valid
    names otherwise."""
    if gem_state not in GEM_STATES:
        raise ValueError(f"unknown gem state {gem_state!r}; valid: {', '.join(GEM_STATES)}")
    try:
        found = _RULES[name]
    except KeyError:
        raise ValueError(f"unknown commit rule {name!r}; valid rules: {', '.join(_RULES)}") from None
    return CompactGemRule if found is GemRule and gem_state == "compact" else found


def create_rule(config: TrainingConfig, num_parameters: int, gem_state: str = "exact", **options: Any) -> CommitRule:
    """`config.rule`'s rule with its hyperparameters; `options` (e.g. `kernel`) go to rules that take them."""
    return rule_class(config.rule, gem_state).from_config(config, num_parameters, **options)


@dataclass(frozen=True)
class RuleRuntime:
    """How the server runs GEM, not what it computes (the server's options of the same names):
    its kernel, what its c counts of a worker's own step, and how it keeps each worker's state."""

    gem_kernel: str = "numpy"
    gem_own_step: str = "counted"
    gem_state: str = "exact"
    DEFAULT: ClassVar[RuleRuntime]

    def create(self, config: TrainingConfig, num_parameters: int) -> CommitRule:
        options = {"kernel": self.gem_kernel, "own_step": self.gem_own_step}
        return create_rule(config, num_parameters, self.gem_state, **options)


RuleRuntime.DEFAULT = RuleRuntime()


__all__ = [
    "GEM_STATES",
    "ApplyStats",
    "CommitRule",
    "NonFiniteUpdate",
    "RuleRuntime",
    "create_rule",
    "rule_class",
    "rule_names",
]
