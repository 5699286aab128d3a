"""The `gemps` command line. Each subcommand imports what it needs lazily, so `gemps server`
runs without torch installed."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemps.client import Client
    from gemps.retry import RetryPolicy

Command = Callable[[argparse.Namespace], int]


def _add_server(parser: argparse.ArgumentParser) -> None:
    from gemps_server import config

    parser.description = "Run the gemps parameter server (flag > GEMPS_* environment variable > default)."
    config.add_arguments(parser)
    parser.set_defaults(run=_run_server)


def _run_server(args: argparse.Namespace) -> int:
    import asyncio

    from gemps_server import app, config

    try:
        server_config = config.from_sources(args)
    except ValueError as error:
        print(f"gemps server: {error}", file=sys.stderr)
        return 2
    asyncio.run(app.serve(server_config))
    return 0


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """How to reach a server that requires TLS or a token (defaults: GEMPS_* variables, as the SDK)."""
    group = parser.add_argument_group("connection (defaults from GEMPS_AUTH_TOKEN, GEMPS_TLS_* variables)")
    group.add_argument("--token", default=None, help="bearer token (env GEMPS_AUTH_TOKEN)")
    group.add_argument("--tls", action="store_true", default=None, help="use TLS (env GEMPS_TLS)")
    group.add_argument("--tls-ca", default=None, help="PEM CA to verify the server; implies --tls (env GEMPS_TLS_CA)")
    group.add_argument("--tls-client-cert", default=None, help="PEM client certificate for mutual TLS")
    group.add_argument("--tls-client-key", default=None, help="PEM key of --tls-client-cert")
    group.add_argument("--tls-server-name", default=None, help="name expected in the server's certificate")


def _client(args: argparse.Namespace, timeout: float, retry: RetryPolicy | None = None) -> Client:
    from gemps.client import Client

    return Client(
        args.server,
        timeout=timeout,
        retry=retry,
        token=args.token,
        tls=args.tls,
        ca_cert=args.tls_ca,
        client_cert=args.tls_client_cert,
        client_key=args.tls_client_key,
        server_name=args.tls_server_name,
    )


def _add_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default 127.0.0.1:50051)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    _add_connection_flags(parser)
    parser.set_defaults(run=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from gemps.errors import GempsError
    from gemps.retry import NO_RETRY

    client = _client(args, timeout=args.timeout, retry=NO_RETRY)
    try:
        status = client.status()
    except GempsError as error:
        print(f"gemps status: {args.server}: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    c = status.config
    print(f"server          {args.server}")
    print(f"initialized     {status.initialized}")
    print(f"version         {status.version}")
    print(f"active workers  {status.active_workers}")
    print(f"parameters      {status.num_parameters} in {len(status.spec)} tensors")
    print(f"commits         {status.commits_applied} applied, {status.commits_rejected} rejected")
    print(f"rule            {c.rule} (eta={c.learning_rate:g} mu={c.momentum:g} kappa={c.kappa:g} pi_max={c.pi_max:g})")
    print(f"uptime          {status.uptime_seconds:.0f}s")
    return 0


def _add_export(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write the central variable as a state dict in safetensors format (no pickle): from a checkpoint "
        "file, the newest good checkpoint in a directory, or a running server. Load it with "
        "model.load_state_dict(safetensors.torch.load_file(OUT))."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("checkpoint", nargs="?", help="checkpoint file, or a --checkpoint-dir to take the newest from")
    source.add_argument("--server", help="HOST:PORT of a running server to pull the central variable from")
    parser.add_argument("--out", required=True, help="file to write (safetensors)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server")
    _add_connection_flags(parser)
    parser.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gemps_server.checkpoint import Checkpoint, CheckpointError, export_state_dict, load, load_latest

    try:
        if args.server:
            from gemps.errors import GempsError

            client = _client(args, timeout=args.timeout)
            try:
                central = client.pull()
            except GempsError as error:
                print(f"gemps export: {args.server}: {error}", file=sys.stderr)
                return 1
            finally:
                client.close()
            checkpoint = Checkpoint(
                version=central.version,
                commits_applied=central.version,
                spec=tuple((s.name, s.shape) for s in central.spec),
                theta=central.flat,
            )
            origin = args.server
        else:
            source = Path(args.checkpoint)
            if source.is_dir():
                found = load_latest(source)
                if found is None:
                    print(f"gemps export: no readable checkpoint in {source}", file=sys.stderr)
                    return 1
                path, checkpoint = found
            else:
                path, checkpoint = source, load(source)
            origin = str(path)
    except (CheckpointError, OSError, ValueError) as error:
        print(f"gemps export: {error}", file=sys.stderr)
        return 1
    size = export_state_dict(checkpoint, Path(args.out), metadata={"source": origin})
    print(
        f"wrote {args.out}: version {checkpoint.version}, {len(checkpoint.spec)} tensors, "
        f"{checkpoint.num_parameters} parameters, {size} bytes"
    )
    return 0


# name -> (one-line help, function that adds the command's flags). Only the command being run
# gets its flags built, so `gemps server` never imports torch, even where it is installed.
Adder = Callable[[argparse.ArgumentParser], None]


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    from gemps import __version__

    parser = argparse.ArgumentParser(
        prog="gemps", description="gemps: an asynchronous parameter server with Gradient Energy Matching."
    )
    parser.add_argument("--version", action="version", version=f"gemps {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (summary, add_flags) in COMMANDS.items():
        command = subparsers.add_parser(
            name, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if name == chosen:
            add_flags(command)
    return parser


def _worker_package_command(module: str, description: str = "") -> Adder:
    """A command from the worker package: it needs torch, so it is imported only when chosen.

    `module` provides `add_arguments(parser)`, which adds the flags and sets `run`.
    """

    def add(parser: argparse.ArgumentParser) -> None:
        try:
            add_arguments: Adder = importlib.import_module(module).add_arguments
        except ImportError as error:
            parser.set_defaults(run=_missing_torch(parser.prog, error))
            return
        if description:
            parser.description = description
        add_arguments(parser)

    return add


def _missing_torch(command: str, error: ImportError) -> Command:
    """A command that explains what to install (the flags of these commands need torch)."""
    message = f"{command} needs the torch extra: pip install 'gemps[torch]' ({error})"

    def explain(args: argparse.Namespace) -> int:
        print(message, file=sys.stderr)
        return 2

    return explain


COMMANDS: dict[str, tuple[str, Adder]] = {
    "server": ("run the parameter server", _add_server),
    "status": ("print a server's status", _add_status),
    "export": ("write the central variable as a safetensors state dict (from a checkpoint or a server)", _add_export),
    "worker": (
        "run one reference training worker",
        _worker_package_command(
            "gemps_worker.cli", "Train on the shard the server assigns, commit every step, leave on SIGTERM."
        ),
    ),
    "evaluate": (
        "measure the central variable on held-out data, periodically",
        _worker_package_command(
            "gemps_worker.evaluator_cli",
            "Evaluate the central variable on held-out data periodically; report it to the server.",
        ),
    ),
    "experiment": (
        "the paper's comparisons, reproduced with the real service",
        _worker_package_command(
            "gemps_worker.experiment.main",
            "Run the GEM paper's comparisons with the real server (resumable) and write curves, figures "
            "and RESULTS.md.",
        ),
    ),
    "demo": (
        "train on this machine: a server and local workers, no containers",
        _worker_package_command("gemps_worker.demo"),
    ),
    "bench": (
        "benchmark gemps against the transport and memory ceilings and peer parameter servers",
        _worker_package_command("benchmarks.cli"),
    ),
}


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
