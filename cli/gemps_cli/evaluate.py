"""`gemps evaluate`: the evaluator, configured by flags or GEMPS_* variables."""

from __future__ import annotations

import argparse
import logging

from gemps import options
from gemps.errors import GempsError, StoppedError
from gemps_cli import environment
from gemps_worker.evaluation_loop import EvaluatorOptions, run_evaluator
from gemps_worker.idx import DatasetError
from gemps_worker.signals import configure_logging, stop_on_signals

log = logging.getLogger("gemps.evaluator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Evaluate the central variable on held-out data periodically; report it to the server."
    options.add_arguments(parser, EvaluatorOptions)
    environment.add_strict_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging()
    if not environment.screen("evaluate", args):
        return 2
    try:
        run_evaluator(options.from_sources(EvaluatorOptions, args), stop_on_signals())
    except StoppedError:
        return 0  # stopped by a signal while the server was unreachable
    except (ValueError, DatasetError, GempsError) as error:
        log.error("evaluator failed: %s", error)
        return 1
    return 0
