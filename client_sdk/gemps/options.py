"""Configuration dataclasses from command-line flags and GEMPS_* environment variables.

Each field of a frozen dataclass becomes a flag named after it (`num_shards` -> `--num-shards`)
and an environment variable (`GEMPS_NUM_SHARDS`); precedence is flag > variable > default, so a
container is configured by environment alone. Field metadata gives the help text (`help`), the
valid `choices`, and the `range` of valid values (gemps_proto.ranges; shown in the help, checked
by the dataclass itself). A field whose default is a dataclass (`field(default_factory=TrainingConfig)`)
contributes that dataclass's fields as flags of their own, so a configuration composed of
others is still one flat list of options.

    @dataclass(frozen=True)
    class MyWorker:
        server: str = field(default="127.0.0.1:50051", metadata={"help": "parameter server"})

    parser = argparse.ArgumentParser(); add_arguments(parser, MyWorker)
    options = from_sources(MyWorker, parser.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from gemps_proto.ranges import range_of

T = TypeVar("T")
Choices = Mapping[str, Sequence[str]]


def env_var(field_name: str) -> str:
    return "GEMPS_" + field_name.upper()


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def _nested(f: dataclasses.Field[Any]) -> type[Any] | None:
    """The dataclass a field composes (its default factory), or None for a plain option."""
    factory = f.default_factory
    if factory is not dataclasses.MISSING and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory
    return None


def options_of(options: type[Any]) -> Iterator[dataclasses.Field[Any]]:
    """The plain option fields of `options`, composed dataclasses flattened in place."""
    for f in dataclasses.fields(options):
        nested = _nested(f)
        if nested is not None:
            yield from options_of(nested)
        else:
            yield f


def _converter(f: dataclasses.Field[Any]) -> Any:
    kind = type(f.default)
    return _parse_bool if kind is bool else kind


def add_arguments(parser: argparse.ArgumentParser, options: type[Any], choices: Choices | None = None) -> None:
    """One flag per option; `choices` adds valid values that the dataclass cannot know (e.g. the
    server's rule names). Flag defaults stay None so environment and defaults can apply."""
    choices = choices or {}
    for f in options_of(options):
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
            help=f"{f.metadata.get('help', '')} (env {env_var(f.name)}; default {f.default!r}{within})",
        )


def from_sources(
    options: type[T], args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> T:
    """Build `options` with precedence flag > GEMPS_* environment variable > default."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        nested = _nested(f)
        if nested is not None:
            values[f.name] = from_sources(nested, args, environ)
            continue
        from_flag = getattr(args, f.name, None) if args is not None else None
        if from_flag is not None:
            values[f.name] = from_flag
        elif env_var(f.name) in environ:
            raw = environ[env_var(f.name)]
            try:
                values[f.name] = _converter(f)(raw)
            except ValueError:
                raise ValueError(f"{env_var(f.name)}={raw!r} is not a valid {f.name}") from None
    return options(**values)


def to_argv(values: Mapping[str, object]) -> list[str]:
    """Flags that set these options (`{"lease_ttl": 2.0}` -> `["--lease-ttl", "2.0"]`)."""
    argv: list[str] = []
    for name, value in values.items():
        argv += [flag(name), str(value)]
    return argv


def values_of(instance: object) -> dict[str, object]:
    """Option name -> value of a configuration dataclass instance, composed ones flattened."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(instance):  # type: ignore[arg-type]
        value = getattr(instance, f.name)
        if _nested(f) is not None:
            out.update(values_of(value))
        else:
            out[f.name] = value
    return out
