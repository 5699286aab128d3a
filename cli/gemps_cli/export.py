"""`gemps export`: the central variable as a safetensors state dict, from a checkpoint or a server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemps.errors import GempsError
from gemps_cli.connection import add_connection_flags, connect
from gemps_server.checkpoints import CheckpointError, export_state_dict, load, load_latest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write the central variable and the model's buffers as a state dict in safetensors format (no "
        "pickle): from a checkpoint file, the newest good checkpoint in a directory, or a running server. Load it with "
        "model.load_state_dict(safetensors.torch.load_file(OUT))."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("checkpoint", nargs="?", help="checkpoint file, or a --checkpoint-dir to take the newest from")
    source.add_argument("--server", help="HOST:PORT of a running server to pull the central variable from")
    parser.add_argument("--out", required=True, help="file to write (safetensors)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server")
    add_connection_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.server:
            client = connect(args, timeout=args.timeout)
            try:
                central = client.pull()
            except GempsError as error:
                print(f"gemps export: {args.server}: {error}", file=sys.stderr)
                return 1
            finally:
                client.close()
            named, version, origin = central.state_dict(), central.version, args.server
            parameters, buffers = central.flat.size, central.buffers.size
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
            named, version, origin = checkpoint.named(), checkpoint.version, str(path)
            parameters, buffers = checkpoint.image.theta.size, checkpoint.image.buffers.size
    except (CheckpointError, OSError, ValueError) as error:
        print(f"gemps export: {error}", file=sys.stderr)
        return 1
    size = export_state_dict(named, version, Path(args.out), metadata={"source": origin})
    counts = f"{parameters} parameters" + (f", {buffers} buffer values" if buffers else "")
    print(f"wrote {args.out}: version {version}, {len(named)} tensors, {counts}, {size} bytes")
    return 0
