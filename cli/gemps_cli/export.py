"""`gemps export`: the central variable as a safetensors state dict, from a checkpoint or a server.

A directory is searched as servers lay it out: checkpoints in it, or one folder per partition
(`partition-<i>`), each with one folder per replica (`replica-<r>`) when replicated; of a
partition's replicas the newest checkpoint (highest version) is taken, and which one is said.
A tied or shared tensor is written under every name the model's `state_dict()` has for it
(gemps.tied_names).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from gemps.errors import GempsError
from gemps.records import CentralVariable
from gemps.retry import NO_RETRY
from gemps.tied_names import expanded
from gemps_cli.connection import add_connection_flags, connect
from gemps_proto.schema import PARTITION_FOLDER
from gemps_server.checkpoint_files import (
    Checkpoint,
    CheckpointError,
    assemble_partitions,
    export_state_dict,
    load,
    load_latest,
)

# A replica's checkpoint folder inside its partition's (gemps_cli.partitions.child_config, on_ray).
REPLICA_FOLDER = re.compile(r"replica-(\d+)")

# A live server's partitions apply each commit one after the other: a pull may land between two
# of them. Pull again this many times before calling the versions mixed.
LIVE_PULLS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write the central variable and the model's buffers as a state dict in safetensors format (no "
        "pickle): from a checkpoint file, the newest good checkpoint in a directory, or a running server. Load it with "
        "model.load_state_dict(safetensors.torch.load_file(OUT))."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "checkpoint",
        nargs="?",
        help="checkpoint file, or a --checkpoint-dir to take the newest from (a partitioned one's partition-*/ "
        "folders assembled; of a replicated one's replica-*/ folders the newest checkpoint, named on stdout)",
    )
    source.add_argument("--server", help="HOST:PORT of a running server to pull the central variable from")
    parser.add_argument("--out", required=True, help="file to write (safetensors)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds the pull may take (a server that does not answer fails at once, as with `gemps status`)",
    )
    parser.add_argument(
        "--allow-mixed-versions",
        action="store_true",
        help="with partitions of θ at different versions (one restarted from an older checkpoint, say), export "
        "them anyway: each range as of its own version. Without it such an export is refused (exit 1)",
    )
    add_connection_flags(parser)
    parser.set_defaults(run=run)


def partition_dirs(directory: Path) -> list[Path]:
    """The per-partition checkpoint directories in `directory`, in partition order (none: not partitioned)."""
    return numbered_dirs(directory, PARTITION_FOLDER)


def numbered_dirs(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The folders of `directory` whose name `pattern` matches, by their number."""
    found = [(m, p) for p in directory.iterdir() if p.is_dir() and (m := pattern.fullmatch(p.name))]
    return [path for _, path in sorted(found, key=lambda item: int(item[0].group(1)))]


def load_newest(directory: Path) -> tuple[Path, Checkpoint]:
    """The newest readable checkpoint in `directory`, or of its replicas' folders (the one at the
    highest version, said on stdout); CheckpointError when there is none."""
    replicas = numbered_dirs(directory, REPLICA_FOLDER)
    if not replicas:
        found = load_latest(directory)
        if found is None:
            raise CheckpointError(f"no readable checkpoint in {directory}")
        return found
    newest = {replica.name: found for replica in replicas if (found := load_latest(replica)) is not None}
    if not newest:
        raise CheckpointError(f"no readable checkpoint in {directory} nor its replicas' folders")
    # The highest version; of equal ones the newer file (a backup may lag, never lead, its primary).
    taken = max(newest, key=lambda name: (newest[name][1].image.version, newest[name][0].stat().st_mtime))
    seen = ", ".join(f"{name} at version {found[1].image.version}" for name, found in newest.items())
    print(f"{directory}: took {taken}'s {newest[taken][0].name} (newest of {seen})")
    return newest[taken]


def mixed_versions(versions: Sequence[int]) -> str:
    """'' when every partition is at one version, else why an export would mix them."""
    if len(set(versions)) <= 1:
        return ""
    listed = ", ".join(f"partition {index} at {version}" for index, version in enumerate(versions))
    return f"the partitions of θ are at different versions ({listed}): the export would mix them"


def pull_live(args: argparse.Namespace) -> CentralVariable:
    """The central variable of a running server; with partitions, pulled again (a few times) while
    a commit in flight has reached some partitions and not the others yet."""
    client = connect(args, timeout=args.timeout, retry=NO_RETRY)  # a server that is down: said at once, as by status
    try:
        central = client.pull()
        for _ in range(LIVE_PULLS - 1):
            if not mixed_versions(central.versions):
                break
            central = client.pull()
        return central
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    try:
        if args.server:
            try:
                central = pull_live(args)
            except GempsError as error:
                print(f"gemps export: {args.server}: {error}", file=sys.stderr)
                return 1
            named, versions, origin = central.state_dict(), list(central.versions), args.server
            parameters, buffers = central.flat.size, central.buffers.size + central.integer_buffers.size
        else:
            source = Path(args.checkpoint)
            checkpoints = [load_newest(folder) for folder in partition_dirs(source)] if source.is_dir() else []
            if not checkpoints:
                checkpoints = [load_newest(source) if source.is_dir() else (source, load(source))]
            origin = ", ".join(str(path) for path, _ in checkpoints)
            images = [checkpoint.image for _, checkpoint in checkpoints]
            loaded = [checkpoint for _, checkpoint in checkpoints]
            named = assemble_partitions(loaded) if len(loaded) > 1 else loaded[0].named()
            versions = [image.version for image in sorted(images, key=lambda image: image.partition.index)]
            parameters, buffers = sum(i.theta.size for i in images), sum(i.buffers.size for i in images)
    except (CheckpointError, OSError, ValueError) as error:
        print(f"gemps export: {error}", file=sys.stderr)
        return 1
    if len(versions) > 1:
        print("partition versions: " + ", ".join(f"{index}: {version}" for index, version in enumerate(versions)))
    if (mixed := mixed_versions(versions)) and not args.allow_mixed_versions:
        print(f"gemps export: {mixed}; nothing written (--allow-mixed-versions writes it anyway)", file=sys.stderr)
        return 1
    version = versions[0]  # with partitions: partition 0's
    metadata = {"source": origin}
    if len(versions) > 1:
        metadata["partition_versions"] = ",".join(map(str, versions))
    named = expanded(named)  # a tied tensor under each of its names
    size = export_state_dict(named, version, Path(args.out), metadata=metadata)
    counts = f"{parameters} parameters" + (f", {buffers} buffer values" if buffers else "")
    mixed_note = " (partitions at different versions, as asked)" if mixed else ""
    print(f"wrote {args.out}: version {version}{mixed_note}, {len(named)} tensors, {counts}, {size} bytes")
    return 0
