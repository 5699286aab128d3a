"""Configuration dataclasses from command-line flags and GEMPS_* environment variables.

Each field of a frozen dataclass becomes a flag named after it (`num_shards` -> `--num-shards`)
and an environment variable (`GEMPS_NUM_SHARDS`); precedence is flag > variable > default, so a
container is configured by environment alone. Field metadata gives the help text (`help`), the
valid `choices`, the `range` of valid values (gemps_proto.ranges; shown in the help, checked
by the dataclass itself) and, for a default computed from other options, its `default_text`.
A field whose default is a dataclass (`field(default_factory=TrainingConfig)`) contributes
that dataclass's fields as flags of their own, so a configuration composed of others is still
one flat list of options. A field whose metadata names options declared elsewhere
(gemps_proto.rule_options.DECLARED: TrainingConfig.rule_options, the commit rules' options)
contributes one flag per option of the `declared` fields the caller hands over (the server's
rule registry: `rule_catalog().fields`), and holds those given as a name -> value map; none where
no caller hands any (what a program knows of the rules is what it passes, not what it imported).
`origins` says where each value came from (for a log of the configuration), and
`unknown_variables` finds the GEMPS_* variables nothing reads, each with the closest known name:
a misspelled variable would otherwise leave its option at the default.

    @dataclass(frozen=True)
    class MyWorker:
        server: str = field(default="127.0.0.1:50051", metadata={"help": "parameter server"})

    parser = argparse.ArgumentParser(); add_arguments(parser, MyWorker)
    options = from_sources(MyWorker, parser.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from gemps_proto.ranges import DEFAULT_TEXT, range_of
from gemps_proto.rule_options import DECLARED, DeclaredFields

T = TypeVar("T")
Choices = Mapping[str, Sequence[str]]


PREFIX = "GEMPS_"
# Where an option's value comes from (`origins`), in from_sources' order of precedence.
FLAG, ENVIRONMENT, DEFAULT = "flag", "environment", "default"


def env_var(field_name: str) -> str:
    return PREFIX + field_name.upper()


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


#: how an on/off flag or variable may be spelled (any case; empty is off)
SWITCHES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_bool(raw: str, name: str | None = None) -> bool:
    """on or off as spelled in SWITCHES; ValueError, naming `name` (a variable), for anything else,
    which would otherwise be read as one of the two without a word."""
    lowered = raw.strip().lower()
    if lowered == "":
        return False
    if lowered not in SWITCHES:
        if name is None:
            raise ValueError(f"not a boolean: {raw!r}")
        raise ValueError(f"{name} must be on or off (1/true/yes/on or 0/false/no/off), not {raw!r}")
    return SWITCHES[lowered]


def _nested(f: dataclasses.Field[Any]) -> type[Any] | None:
    """The dataclass a field composes (its default factory), or None for a plain option."""
    factory = f.default_factory
    if factory is not dataclasses.MISSING and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory
    return None


def _holds_declared(f: dataclasses.Field[Any]) -> bool:
    """Whether a field holds options declared elsewhere as a map (DECLARED), not a plain option."""
    return DECLARED in f.metadata


def options_of(options: type[Any], declared: DeclaredFields | None = None) -> Iterator[dataclasses.Field[Any]]:
    """The plain option fields of `options`, composed dataclasses flattened in place, and the
    `declared` options in place of the field that holds them (none without `declared`)."""
    for f in dataclasses.fields(options):
        nested = _nested(f)
        if nested is not None:
            yield from options_of(nested, declared)
        elif _holds_declared(f):
            yield from declared() if declared is not None else ()
        else:
            yield f


def _converter(f: dataclasses.Field[Any]) -> Any:
    # A default of a subclass (a marker, e.g. the server's ports that follow --port) converts as its base.
    for kind in (bool, int, float, str):
        if isinstance(f.default, kind):
            return parse_bool if kind is bool else kind
    return type(f.default)


def _default_text(f: dataclasses.Field[Any]) -> str:
    """The default as `--help` says it: the field's `default_text` (a default computed from other
    options, e.g. "--port + 1000"), else its value."""
    return str(f.metadata.get(DEFAULT_TEXT, repr(f.default)))


def add_arguments(
    parser: argparse.ArgumentParser,
    options: type[Any],
    choices: Choices | None = None,
    declared: DeclaredFields | None = None,
) -> None:
    """One flag per option; `choices` adds valid values that the dataclass cannot know (e.g. the
    server's rule names), `declared` the options declared elsewhere (e.g. the rules' options).
    Flag defaults stay None so environment and defaults can apply."""
    choices = choices or {}
    for f in options_of(options, declared):
        valid = choices.get(f.name, f.metadata.get("choices"))
        bounds = range_of(f)
        within = f"; range {bounds}" if bounds is not None else ""
        parser.add_argument(
            flag(f.name),
            dest=f.name,
            type=_converter(f),
            default=None,
            metavar=None if valid else f.name.upper(),
            choices=valid,
            help=f"{f.metadata.get('help', '')} (env {env_var(f.name)}; default {_default_text(f)}{within})",
        )


def from_sources(
    options: type[T],
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    declared: DeclaredFields | None = None,
) -> T:
    """Build `options` with precedence flag > GEMPS_* environment variable > default (`declared`:
    the options declared elsewhere that a DECLARED field holds, as add_arguments was given them)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        nested = _nested(f)
        if nested is not None:
            values[f.name] = from_sources(nested, args, environ, declared)
            continue
        if _holds_declared(f):  # only those given: the dataclass says what the others are
            found = {d.name: _lookup(d, args, environ) for d in (declared() if declared is not None else ())}
            values[f.name] = {name: value for name, (origin, value) in found.items() if origin != DEFAULT}
            continue
        origin, value = _lookup(f, args, environ)
        if origin != DEFAULT:
            values[f.name] = value
    return options(**values)


def origins(
    options: type[Any],
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    declared: DeclaredFields | None = None,
) -> dict[str, str]:
    """Where each option of `options` takes its value from, as `from_sources` decides: FLAG,
    ENVIRONMENT or DEFAULT (composed dataclasses and `declared` options flattened, as `values_of`)."""
    environ = os.environ if environ is None else environ
    return {f.name: _lookup(f, args, environ)[0] for f in options_of(options, declared)}


def _lookup(f: dataclasses.Field[Any], args: argparse.Namespace | None, environ: Mapping[str, str]) -> tuple[str, Any]:
    """(origin, value) of one plain option; the value is None for DEFAULT (the dataclass's own)."""
    from_flag = getattr(args, f.name, None) if args is not None else None
    if from_flag is not None:
        return FLAG, from_flag
    name = env_var(f.name)
    if name not in environ:
        return DEFAULT, None
    raw = environ[name]
    try:
        return ENVIRONMENT, _converter(f)(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {f.name}") from None


def unknown_variables(
    environ: Mapping[str, str], options: Collection[str], others: Collection[str] = ()
) -> list[UnknownVariable]:
    """The GEMPS_* variables of `environ` that are neither `options` nor `others` (variables read
    elsewhere), each with the closest known name: a misspelling would otherwise leave its option at
    the default without a word."""
    known = set(options) | set(others)
    # Compared without the prefix they all share, which would make any two names look alike.
    suffixes = {name.removeprefix(PREFIX): name for name in known}

    def closest(name: str) -> str | None:
        found = difflib.get_close_matches(name.removeprefix(PREFIX), sorted(suffixes), n=1)
        return suffixes[found[0]] if found else None

    return [
        UnknownVariable(name, closest(name))
        for name in sorted(environ)
        if name.startswith(PREFIX) and name not in known
    ]


@dataclasses.dataclass(frozen=True)
class UnknownVariable:
    """A GEMPS_* variable that nothing reads, and the known name closest to it (None: none close)."""

    name: str
    closest: str | None

    def __str__(self) -> str:
        hint = f"did you mean {self.closest}?" if self.closest else "none is close"
        return f"{self.name} is not a gemps option ({hint})"


def to_argv(values: Mapping[str, object]) -> list[str]:
    """Flags that set these options (`{"lease_ttl": 2.0}` -> `["--lease-ttl", "2.0"]`)."""
    argv: list[str] = []
    for name, value in values.items():
        argv += [flag(name), str(value)]
    return argv


def values_of(instance: object) -> dict[str, object]:
    """Option name -> value of a configuration dataclass instance, composed ones and declared options flattened."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(instance):  # type: ignore[arg-type]
        value = getattr(instance, f.name)
        if _nested(f) is not None:
            out.update(values_of(value))
        elif _holds_declared(f):
            out.update(value)
        else:
            out[f.name] = value
    return out
