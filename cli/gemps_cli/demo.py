"""`gemps demo`: train on this machine, a server and local worker processes, no containers."""

from __future__ import annotations

import argparse
import sys

from gemps import options
from gemps_server.domain.rules import rule_names
from gemps_worker import demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = demo.__doc__
    options.add_arguments(parser, demo.DemoOptions, choices={"rule": rule_names()})
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        demo_options = options.from_sources(demo.DemoOptions, args)
    except ValueError as error:
        print(f"gemps demo: {error}", file=sys.stderr)
        return 2
    problems = demo_options.problems() + demo_options.training.problems()
    if problems:
        print(f"gemps demo: {'; '.join(problems)}", file=sys.stderr)
        return 2
    return demo.run_demo(demo_options)
