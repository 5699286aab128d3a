"""`gemps status`: a running server's state, for humans."""

from __future__ import annotations

import argparse
import sys

from gemps.errors import GempsError
from gemps.records import ReplicationStatus, ServerStatus, WorkerStatus
from gemps.retry import NO_RETRY
from gemps_cli.connection import add_connection_flags, connect
from gemps_proto import versions
from gemps_proto.status import PRIMARY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default 127.0.0.1:50051)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    add_connection_flags(parser)
    parser.set_defaults(run=run)


# Workers listed at most: the quietest first, which are the ones a reader looks for.
MAX_WORKERS_LISTED = 20


def run(args: argparse.Namespace) -> int:
    client = connect(args, timeout=args.timeout, retry=NO_RETRY)
    unreachable = ""
    try:
        first = client.status()
        try:
            statuses = client.statuses() if first.layout is not None else [first]
        except GempsError as error:  # e.g. through a port-forward to partition 0 alone
            statuses, unreachable = [first], str(error)
    except GempsError as error:
        print(f"gemps status: {args.server}: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    statuses, asked = primaries_views(args, statuses)
    status = statuses[0]
    settings = " ".join(f"{name}={value:g}" for name, value in status.config.as_dict().items() if type(value) is float)
    print(f"server          {args.server}")
    print(f"software        {(status.versions or versions.LEGACY).describe()}")
    print(f"initialized     {status.initialized}")
    print(f"version         {status.version}")
    lease = f" (each evicted after {status.lease_ttl_seconds:g}s unseen)" if status.lease_ttl_seconds else ""
    print(f"active workers  {status.active_workers}{lease}")
    parameters = status.layout.num_parameters if status.layout is not None else status.num_parameters
    print(f"parameters      {parameters} in {len(status.spec)} tensors")
    if status.buffer_spec:
        print(f"buffers         {sum(entry.size for entry in status.buffer_spec)} in {len(status.buffer_spec)} tensors")
    print(f"commits         {status.commits_applied} applied, {status.commits_rejected} rejected")
    print(f"rule state      {memory_line(status)}")
    print(f"rule            {status.config.rule} ({settings})")
    print(f"learning rate   {status.learning_rate:g} now ({status.config.lr_schedule} schedule)")
    # Partitions' sums add up to the whole of θ's; with some partitions unreachable, partition 0's slice only.
    noise = client.gradient_noise(statuses).describe(status.active_workers)
    what = noise.removeprefix("noise scale").lstrip(":").strip()
    print(f"noise scale     {what}" + (" (partition 0's slice)" if unreachable else ""))
    print(f"uptime          {status.uptime_seconds:.0f}s")
    if unreachable:
        print(
            f"partitions      {len(status.layout.partitions) if status.layout else 1}, not all reachable from "
            f"here ({unreachable}): the figures above are partition 0's"
        )
    elif status.layout is not None:  # θ is partitioned: the figures above are partition 0's
        print(f"partitions      {len(statuses)} (figures above: partition 0's)")
        for index, (part, where) in enumerate(zip(statuses, client.targets, strict=True)):
            assert part.layout is not None
            share = part.layout.partitions[index]
            print(
                f"  {index}  {where:<21} values {share.start}..{share.stop - 1}  version {part.version}  "
                f"workers {part.active_workers}  commits {part.commits_applied} applied, "
                f"{part.commits_rejected} rejected"
            )
    print_replication(statuses, asked)
    print_workers(status.workers, partitioned=status.layout is not None)
    return 0


def memory_line(status: ServerStatus) -> str:
    """The workers' rule state against the memory budget: "1.0 GiB of a 4.0 GiB budget (25%)"."""
    used = _bytes(status.rule_state_bytes)
    budget = status.memory_budget_bytes
    if not budget:
        return f"{used} (no memory budget: not initialised, or no limit found)"
    share = f"{100 * status.rule_state_bytes / budget:.0f}%"
    return f"{used} of a {_bytes(budget)} memory budget ({share}; raise it with --memory-budget-mb)"


def _bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def primaries_views(args: argparse.Namespace, statuses: list[ServerStatus]) -> tuple[list[ServerStatus], list[str]]:
    """Each replicated partition as its primary sees it (its backups' lag, under-replication):
    where the address given reached a backup that names its primary, the primary is asked. With
    the primary's address for each partition it asked ("": none asked, or it did not answer)."""
    views, asked = list(statuses), [""] * len(statuses)
    for index, status in enumerate(statuses):
        replication = status.replication
        if replication is None or replication.role == PRIMARY or not replication.primary:
            continue
        there = argparse.Namespace(**{**vars(args), "server": replication.primary})
        try:
            with connect(there, args.timeout, NO_RETRY) as primary:
                view = primary.status()
        except GempsError:
            continue  # the backup's own view, which names the primary it follows
        if view.replication is not None and view.replication.role == PRIMARY:
            views[index], asked[index] = view, replication.primary
    return views, asked


def print_replication(statuses: list[ServerStatus], asked: list[str]) -> None:
    """Each replicated partition's replica that answered (its primary, when `asked` names it): its
    role and epoch; on a primary, the live replicas against R and each backup's lag; on a backup,
    the primary it follows."""
    if all(status.replication is None for status in statuses):
        return
    if len(statuses) == 1:
        head, *backups = replication_lines(statuses[0].replication)
        print(f"replication     {head}{_asked(asked[0])}")
        for line in backups:
            print(f"  {line}")
        return
    print("replication     by partition (the replica each partition's address reached, or its primary)")
    for index, status in enumerate(statuses):
        head, *backups = replication_lines(status.replication)
        print(f"  {index}  {head}{_asked(asked[index])}")
        for line in backups:
            print(f"       {line}")


def _asked(primary: str) -> str:
    return f" (at {primary}: the address given reached a backup)" if primary else ""


def replication_lines(replication: ReplicationStatus | None) -> list[str]:
    """A head line for the replica, then one line per backup (a primary's)."""
    if replication is None:
        return ["not replicated"]
    r = replication
    if r.role != PRIMARY:
        follows = f"follows {r.primary}" if r.primary else "no primary known"
        head = f"{r.role} {r.name}, epoch {r.epoch}, {follows} ({r.replicas} replicas configured)"
        return [head, f"UNAVAILABLE: {r.unavailable}"] if r.unavailable else [head]
    under = " UNDER-REPLICATED" if r.under_replicated else ""
    head = f"primary {r.name}, epoch {r.epoch}, {r.live}/{r.replicas} replicas live{under}"
    return [head] + [
        f"backup {backup.name:<16} {'in sync' if backup.in_sync else 'OUT OF SYNC':<11}  "
        f"lag {backup.lag_commits} commits, {_age(backup.lag_seconds)}"
        for backup in r.backups
    ]


def print_workers(workers: tuple[WorkerStatus, ...], *, partitioned: bool = False) -> None:
    """One line per registered worker, the longest unseen first: a worker that ended without
    leaving stays registered until its lease expires, and shows here as not seen for a while."""
    if not workers:
        return
    print("workers         the longest unseen first" + (" (partition 0's)" if partitioned else ""))
    quietest = sorted(workers, key=lambda worker: -worker.seconds_since_seen)
    for worker in quietest[:MAX_WORKERS_LISTED]:
        print(
            f"  shard {worker.shard:<4} {worker.name or '(no name)':<16} last seen {_age(worker.seconds_since_seen)} "
            f"ago, last commit {_age(worker.seconds_since_commit)} ago, {worker.commits} commits"
        )
    if len(quietest) > MAX_WORKERS_LISTED:
        rest = quietest[MAX_WORKERS_LISTED:]
        print(f"  and {len(rest)} more, each seen within {_age(rest[0].seconds_since_seen)}")


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
