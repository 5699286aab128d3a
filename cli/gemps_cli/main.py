"""`gemps COMMAND ...`: the command table and dispatch.

Each command is a module of this package with `add_arguments(parser)` (which also sets `run`);
only the chosen command's module is imported, so a command never pays for another's
dependencies (`gemps server` never imports torch, even where it is installed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from gemps_cli import extras

Command = Callable[[argparse.Namespace], int]

SERVER = ("server",)
TORCH = ("torch",)
SERVER_AND_TORCH = ("server", "torch")

# name -> (one-line help, module under gemps_cli, the extras it needs; `gemps status` needs none:
# the base install is the SDK)
COMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "server": ("run the parameter server", "server", SERVER),
    "status": ("print a server's status", "status", ()),
    "export": (
        "write the central variable as a safetensors state dict (from a checkpoint or a server)",
        "export",
        SERVER,
    ),
    "worker": ("run one reference training worker", "worker", TORCH),
    "evaluate": ("measure the central variable on held-out data, periodically", "evaluate", TORCH),
    "experiment": ("the paper's comparisons, reproduced with the real service", "experiment", SERVER_AND_TORCH),
    "demo": ("train on this machine: a server and local workers, no containers", "demo", SERVER_AND_TORCH),
    "ray": (
        "train on a Ray cluster: partitions, workers and the evaluator as Ray actors",
        "ray_job",
        ("ray", "server", "torch"),
    ),
    "plan": (
        "project what a job needs (partitions, local steps, server cores and memory) and its commits/s",
        "plan",
        (),
    ),
    "bench": (
        "benchmark gemps against the transport and memory ceilings and peer parameter servers",
        "bench",
        SERVER_AND_TORCH,
    ),
}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    from gemps import __version__

    parser = argparse.ArgumentParser(
        prog="gemps", description="gemps: an asynchronous parameter server with Gradient Energy Matching."
    )
    parser.add_argument("--version", action="version", version=f"gemps {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (summary, module, needed) in COMMANDS.items():
        command = subparsers.add_parser(
            name, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if name == chosen:
            _add_command(command, module, needed)
    return parser


def _add_command(parser: argparse.ArgumentParser, module: str, needed: tuple[str, ...]) -> None:
    absent = extras.missing(needed)
    if absent:
        _explain_missing(parser, needed, f"missing: {', '.join(absent)}")
        return
    try:
        add_arguments: Callable[[argparse.ArgumentParser], None] = importlib.import_module(
            f"gemps_cli.{module}"
        ).add_arguments
    except ImportError as error:
        if not needed:
            raise
        _explain_missing(parser, needed, str(error))
        return
    add_arguments(parser)


def _explain_missing(parser: argparse.ArgumentParser, needed: tuple[str, ...], why: str) -> None:
    """The command says what to install, whatever flags it was given (its flags need the extras' packages)."""
    message = f"{extras.install_hint(parser.prog, needed)} ({why})"

    def explain(args: argparse.Namespace) -> int:
        print(message, file=sys.stderr)
        return 2

    parser.epilog = message
    parser.set_defaults(run=explain, flags_unknown=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "flags_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
