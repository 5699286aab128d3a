"""A commit rule's own options: how a rule declares each, and the catalog a set of rules makes.

Every rule takes the learning rate and its schedule (TrainingConfig's fields); a rule's own knobs
(GEM's mu, kappa and pi_max, the momentum rule's mu) are its options. The rules are the server's:
each declares its options (RuleOption: name, default, range, help), and the server's rule registry
(gemps_server.domain.rules) builds its RuleCatalog from the rules registered there. Everything else
reads them from the config or from that catalog, handed to it: the wire carries them as one name
-> value map (TrainingConfig.rule_options), checkpoint metadata, Status, logs and the info metric
list that map (TrainingConfig.as_dict), and gemps.options makes a flag and a GEMPS_* variable of
each option of the catalog it is given (`--momentum`, `GEMPS_MOMENTUM`) for the commands that start
a server. There is no catalog of the process: a TrainingConfig checks its own fields the same in
every process, whatever it imported, and a rule's options are checked by the catalog of the rules
that run them (the server's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from gemps_proto.ranges import RANGE, Range

_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
#: The option a rule declares when it moves θ a round of commits at a time (adamw's K): a client
#: that finds it in its registration's TrainingConfig.rule_options knows θ holds still while a
#: round is open (gemps.pytorch.LocalSteps then never looks ahead).
ROUND_SIZE = "round_size"
#: The option with which such a rule closes its rounds of update commits with an outer step of
#: that rate on their mean, its own learning rate unused (adamw's DiLoCo rounds; 0: off).
OUTER_RATE = "outer_rate"


@dataclass(frozen=True)
class RuleOption:
    """One option of a commit rule: its name (a flag `--name`, a variable `GEMPS_NAME`, a key of
    TrainingConfig.rule_options), its default, the range its values must lie in, and its help.
    An option whose default is an int takes whole numbers only (the wire carries a double)."""

    name: str
    default: float
    within: Range
    help: str

    def __post_init__(self) -> None:
        # A flag, a variable and a metric label are made of it: lowercase words joined by "_".
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"rule option name {self.name!r} is not lowercase words joined by '_' (e.g. pi_max)")

    @property
    def kind(self) -> type[float] | type[int]:
        return int if isinstance(self.default, int) and not isinstance(self.default, bool) else float

    def problems(self, value: float) -> list[str]:
        """What is wrong with `value` for this option: outside its range, or not whole for an int option."""
        if self.kind is int and isinstance(value, float) and not value.is_integer():
            return [f"{self.name} {value!r} is not a whole number"]
        return [] if self.within.admits(value) else [f"{self.name} {value!r} is outside {self.within}"]


class OptionValues(dict[str, float]):
    """A rule's option values by name, as TrainingConfig holds them: read-only and hashable like
    the frozen config itself, and still a dict (json and dataclasses.asdict take it as one)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a config's rule options are read-only: dataclasses.replace(config, rule_options=...)")

    def __reduce__(self) -> tuple[type[OptionValues], tuple[dict[str, float]]]:
        """Pickled whole, made again from a plain dict (pickle's dict path would set items one by
        one, which a read-only mapping refuses: Ray pickles a config inside every Status)."""
        return OptionValues, (dict(self),)

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only


class RuleCatalog:
    """The rules this process knows, each with the options it takes (declared by the server's rule
    registry). An option name means one thing: rules that share one (gem's and momentum's mu)
    declare the same RuleOption, so it is one flag with one default and range."""

    def __init__(self) -> None:
        self._rules: dict[str, tuple[RuleOption, ...]] = {}

    def declare(self, rule: str, options: Sequence[RuleOption]) -> None:
        """Enter `rule` with its options; ValueError when one of them shares a name with another
        rule's option but not its declaration, or the rule names one option twice."""
        names = [option.name for option in options]
        if len(set(names)) != len(names):
            raise ValueError(f"rule {rule!r} declares an option twice: {', '.join(names)}")
        for option in options:
            known = self.option(option.name)
            if known is not None and known != option:
                owners = ", ".join(self.rules_taking(option.name))
                raise ValueError(
                    f"rule {rule!r} declares option {option.name!r} unlike rule {owners}'s: "
                    f"{option} against {known} (an option name is one flag: declare one RuleOption and share it)"
                )
        self._rules[rule] = tuple(options)

    def withdraw(self, rule: str) -> None:
        """Forget `rule` (a rule registered for a while, as a test's)."""
        self._rules.pop(rule, None)

    def knows(self, rule: str) -> bool:
        return rule in self._rules

    def options_of(self, rule: str) -> tuple[RuleOption, ...]:
        """The options `rule` takes (none for a rule this catalog does not know)."""
        return self._rules.get(rule, ())

    def option(self, name: str) -> RuleOption | None:
        return next((o for options in self._rules.values() for o in options if o.name == name), None)

    def declared(self) -> list[RuleOption]:
        """Every option some rule takes, once each, in the order rules declared them."""
        found: dict[str, RuleOption] = {}
        for options in self._rules.values():
            found.update({option.name: option for option in options if option.name not in found})
        return list(found.values())

    def rules_taking(self, name: str) -> list[str]:
        return [rule for rule, options in self._rules.items() if any(o.name == name for o in options)]

    def problems(self, rule: str, values: Mapping[str, float]) -> list[str]:
        """What is wrong with `values` as `rule`'s options (option_problems), naming the rules that
        take an option it does not; none for a rule this catalog does not know (the server's
        registry says the rule is unknown)."""
        if rule not in self._rules:
            return []
        return option_problems(rule, self._rules[rule], values, self.rules_taking)

    def resolved(self, rule: str, values: Mapping[str, float]) -> dict[str, float]:
        """`values` with each option of `rule` that they leave out at its default, in the order
        the rule declares them (as they are for a rule this catalog does not know)."""
        if rule not in self._rules:
            return dict(values)
        return {option.name: values.get(option.name, option.default) for option in self._rules[rule]}

    def fields(self) -> tuple[dataclasses.Field[Any], ...]:
        """Each declared option as a dataclass field (its default, help and range), for gemps.options
        to make a flag and a GEMPS_* variable of; the help names the rules that take it."""
        made = dataclasses.make_dataclass(
            "DeclaredRuleOptions",
            [
                (
                    option.name,
                    option.kind,
                    dataclasses.field(
                        default=option.default,
                        metadata={
                            "help": f"{option.help}; {_rules(self.rules_taking(option.name))}",
                            RANGE: option.within,
                        },
                    ),
                )
                for option in self.declared()
            ],
            frozen=True,
        )
        return dataclasses.fields(made)


def option_problems(
    rule: str,
    taken: Sequence[RuleOption],
    values: Mapping[str, float],
    taking: Callable[[str], list[str]] = lambda name: [],
) -> list[str]:
    """What is wrong with `values` as the options of `rule`, which takes `taken`: one it does not
    take (nothing given is ignored; `taking` names the rules that do), or a value its option refuses."""
    by_name = {option.name: option for option in taken}
    found = []
    for name, value in values.items():
        if name in by_name:
            found += by_name[name].problems(value)
            continue
        takes = f"its options: {', '.join(by_name)}" if by_name else "it takes none"
        others = taking(name)
        elsewhere = f"; {_rules(others)} {'take' if len(others) > 1 else 'takes'} it" if others else ""
        found.append(f"rule {rule!r} takes no option {name!r} ({takes}{elsewhere})")
    return found


def _rules(names: Sequence[str]) -> str:
    return f"rule{'s' if len(names) > 1 else ''} {', '.join(names)}"


#: The metadata key of a field whose value maps names to values of options declared elsewhere
#: (TrainingConfig.rule_options: a catalog's): gemps.options makes a flag of each option of the
#: catalog it is given (RuleCatalog.fields), and none without one.
DECLARED = "declared"

DeclaredFields = Callable[[], Iterable[dataclasses.Field[Any]]]

# The options each rule took while they were TrainingConfig fields of their own (momentum, kappa,
# pi_max, sent and recorded for every rule): how values from then are read now, from a server
# from before rule_options and from experiment results of then. A record of the past, never extended.
_LEGACY_OPTIONS = {"gem": ("momentum", "kappa", "pi_max"), "momentum": ("momentum",), "nesterov": ("momentum",)}
#: the former TrainingConfig fields that were rule options
LEGACY_NAMES = ("momentum", "kappa", "pi_max")


def legacy_options(rule: str, values: Mapping[str, Any]) -> dict[str, float]:
    """The options `rule` took from the former fields' `values` (by name; those of other rules dropped)."""
    return {name: float(values[name]) for name in _LEGACY_OPTIONS.get(rule, ()) if name in values}
