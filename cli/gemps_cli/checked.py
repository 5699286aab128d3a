"""A run's options from flags and GEMPS_* variables, checked before anything starts."""

from __future__ import annotations

import argparse
import sys
from typing import Protocol, TypeVar

from gemps import options
from gemps_cli import environment
from gemps_proto.schema import TrainingConfig


class RunOptions(Protocol):
    """Options of a command that trains: its own checks, and the training config's."""

    @property
    def training(self) -> TrainingConfig: ...

    def problems(self) -> list[str]: ...


T = TypeVar("T", bound=RunOptions)


def checked_options(kind: type[T], args: argparse.Namespace, command: str) -> T | None:
    """`kind` from the flags and variables, or None once what is wrong is on stderr."""
    if not environment.screen(command, args):
        return None
    try:
        found = options.from_sources(kind, args)
    except ValueError as error:
        print(f"gemps {command}: {error}", file=sys.stderr)
        return None
    problems = found.problems() + found.training.problems()
    if problems:
        print(f"gemps {command}: {'; '.join(problems)}", file=sys.stderr)
        return None
    return found
