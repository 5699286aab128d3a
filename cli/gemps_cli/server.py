"""`gemps server`: run the parameter server, configured by flags or GEMPS_* variables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from gemps import options
from gemps_cli import environment
from gemps_cli.checked import add_training_arguments
from gemps_server.config import ServerConfig
from gemps_server.domain.rules import rule_catalog


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run the gemps parameter server (flag > GEMPS_* environment variable > default)."
    add_training_arguments(parser, ServerConfig)
    environment.add_strict_flag(parser)
    parser.set_defaults(run=run)


def parse_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The configuration `gemps server ARGV` runs with (raises ValueError for invalid values)."""
    parser = argparse.ArgumentParser(prog="gemps server")
    add_arguments(parser)
    return options.from_sources(ServerConfig, parser.parse_args(argv), environ, rule_catalog().fields)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from gemps_server import app

    try:
        config = options.from_sources(ServerConfig, args, declared=rule_catalog().fields)
    except ValueError as error:
        print(f"gemps server: {error}", file=sys.stderr)
        return 2
    supervised = (config.partitions > 1 and config.partition_index == -1) or (
        config.replicas > 1 and config.replica_index == -1
    )
    # The logs as configured before the first warning; serve() configures them again, with its tags.
    app.configure_logs(config, origin="supervisor" if supervised else "")
    if not environment.screen("server", args):
        return 2
    if supervised:  # all partitions and replicas, one process each (their environment has no strays)
        from gemps_cli.partitions import PartitionSupervisor
        from gemps_server import process_title

        process_title.show(process_title.supervisor_title(config))

        return PartitionSupervisor(config).run()
    asyncio.run(app.serve(config, origins=options.origins(ServerConfig, args, declared=rule_catalog().fields)))
    return 0
