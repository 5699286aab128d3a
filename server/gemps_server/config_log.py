"""The server's effective configuration, logged once at start with where each value came from.

A value set by a misspelled variable stays at its default without a word; this line shows what
the server really runs with, so `learning_rate=0.05` next to `from_environment=rule` is seen.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from gemps_server.config import ServerConfig
from gemps_server.logs import FieldValue, event

log = logging.getLogger("gemps.server")

# Options whose value is never written to a log; a set one shows as REDACTED.
SECRET_OPTIONS = frozenset({"auth_token", "etcd_password"})
REDACTED = "<redacted>"


def effective_values(config: ServerConfig) -> dict[str, FieldValue]:
    """Option name -> the value it runs with, the training config's fields flattened, secrets redacted."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "training"}
    values.update(config.training.as_dict())
    return {name: REDACTED if name in SECRET_OPTIONS and value else _loggable(value) for name, value in values.items()}


def log_configuration(config: ServerConfig, origins: Mapping[str, str] | None = None) -> None:
    """One INFO event `configuration`: the options set by flag and by environment variable (names,
    from `origins`, which gemps.options.origins gives; every other one is its default), then
    every option's value."""
    origins = origins or {}

    def named(origin: str) -> str | None:
        return ",".join(name for name, found in origins.items() if found == origin) or None

    # Typed Any for `event`'s keywords (its `level` is an int), as the serving line's fields are.
    fields: dict[str, Any] = {"from_flags": named("flag"), "from_environment": named("environment")}
    fields.update(effective_values(config))
    event(log, "configuration", **fields)


def _loggable(value: object) -> FieldValue:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
