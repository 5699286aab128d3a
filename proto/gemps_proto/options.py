"""Options for every gemps component from a frozen dataclass: flag > GEMPS_* env var > default.

Each field becomes a flag named after it (`num_shards` -> `--num-shards`) and an environment
variable (`GEMPS_NUM_SHARDS`); containers are configured by environment alone. Field metadata
gives the help text (`help`) and optional `choices`. Lives beside the protocol because it is the
one package that the server, the SDK and the worker all share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


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


def _converter(f: dataclasses.Field[Any]) -> Any:
    kind = type(f.default)
    return _parse_bool if kind is bool else kind


def add_arguments(parser: argparse.ArgumentParser, options: type[Any]) -> None:
    """One flag per field; flag defaults stay None so environment and defaults can apply."""
    for f in dataclasses.fields(options):
        parser.add_argument(
            flag(f.name),
            dest=f.name,
            type=_converter(f),
            default=None,
            metavar=None if "choices" in f.metadata else f.name.upper(),
            choices=f.metadata.get("choices"),
            help=f"{f.metadata.get('help', '')} (env {env_var(f.name)}; default {f.default!r})",
        )


def from_sources(
    options: type[T], args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> T:
    """Build `options` with precedence flag > GEMPS_* environment variable > default."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
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
