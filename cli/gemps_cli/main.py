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

Command = Callable[[argparse.Namespace], int]

# name -> (one-line help, module under gemps_cli, the extra its imports need: "", "torch" or "ray")
COMMANDS: dict[str, tuple[str, str, str]] = {
    "server": ("run the parameter server", "server", ""),
    "status": ("print a server's status", "status", ""),
    "export": ("write the central variable as a safetensors state dict (from a checkpoint or a server)", "export", ""),
    "worker": ("run one reference training worker", "worker", "torch"),
    "evaluate": ("measure the central variable on held-out data, periodically", "evaluate", "torch"),
    "experiment": ("the paper's comparisons, reproduced with the real service", "experiment", "torch"),
    "demo": ("train on this machine: a server and local workers, no containers", "demo", "torch"),
    "ray": ("train on a Ray cluster: partitions, workers and the evaluator as Ray actors", "ray_job", "ray"),
    "bench": (
        "benchmark gemps against the transport and memory ceilings and peer parameter servers",
        "bench",
        "torch",
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
    for name, (summary, module, extra) in COMMANDS.items():
        command = subparsers.add_parser(
            name, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if name == chosen:
            _add_command(command, module, extra)
    return parser


def _add_command(parser: argparse.ArgumentParser, module: str, extra: str) -> None:
    try:
        add_arguments: Callable[[argparse.ArgumentParser], None] = importlib.import_module(
            f"gemps_cli.{module}"
        ).add_arguments
    except ImportError as error:
        if not extra:
            raise
        parser.set_defaults(run=_missing_extra(parser.prog, extra, error))
        return
    add_arguments(parser)


def _missing_extra(command: str, extra: str, error: ImportError) -> Command:
    """A command that explains what to install (its flags need the extra's packages)."""
    message = f"{command} needs the {extra} extra: pip install 'gemps[{extra}]' ({error})"

    def explain(args: argparse.Namespace) -> int:
        print(message, file=sys.stderr)
        return 2

    return explain


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
