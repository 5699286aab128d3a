"""`gemps demo`: train on this machine, a server and local worker processes, no containers."""

from __future__ import annotations

import argparse

from gemps_cli import environment
from gemps_cli.checked import add_training_arguments, checked_options
from gemps_worker import demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = demo.__doc__
    add_training_arguments(parser, demo.DemoOptions)
    environment.add_strict_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    demo_options = checked_options(demo.DemoOptions, args, "demo")
    return 2 if demo_options is None else demo.run_demo(demo_options)
