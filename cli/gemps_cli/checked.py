"""A run's options from flags and GEMPS_* variables, checked before anything starts."""

from __future__ import annotations

import argparse
import sys
from typing import Protocol, TypeVar

from gemps import options
from gemps_cli import environment
from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules import rule_catalog, rule_names, training_problems


class RunOptions(Protocol):
    """Options of a command that trains: its own checks, and the training config's."""

    @property
    def training(self) -> TrainingConfig: ...

    def problems(self) -> list[str]: ...


T = TypeVar("T", bound=RunOptions)


def add_training_arguments(parser: argparse.ArgumentParser, kind: type[object]) -> None:
    """A flag for each option of `kind` (a command that trains), with the registered rules' names
    and a flag for each of their options (`--momentum`)."""
    options.add_arguments(parser, kind, choices={"rule": rule_names()}, declared=rule_catalog().fields)


def checked_options(kind: type[T], args: argparse.Namespace, command: str) -> T | None:
    """`kind` from the flags and variables (`add_training_arguments`' flags), or None once what is
    wrong is on stderr."""
    if not environment.screen(command, args):
        return None
    try:
        found = options.from_sources(kind, args, declared=rule_catalog().fields)
    except ValueError as error:
        print(f"gemps {command}: {error}", file=sys.stderr)
        return None
    problems = found.problems() + training_problems(found.training)
    if problems:
        print(f"gemps {command}: {'; '.join(problems)}", file=sys.stderr)
        return None
    return found
