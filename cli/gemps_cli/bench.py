"""`gemps bench`: gemps against the transport and memory ceilings and peer parameter servers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemps_bench import cross_host, failover, replicas
from gemps_bench.counts import parse_counts
from gemps_bench.main import DESCRIPTION, run_bench, run_cross_host_bench, run_failover_bench, run_replicas_bench
from gemps_bench.suite import FULL, QUICK, SYSTEMS, select

from gemps_worker.simulated_hosts import rate_bits_per_second, unavailable_reason


def _counts(text: str) -> list[int]:
    try:
        return parse_counts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _systems(text: str) -> list[str]:
    """Systems of the loopback suite or of the cross-host one (--link): each checks its own."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    between_hosts = (*cross_host.SYSTEMS, *cross_host.OPTIONAL_SYSTEMS)
    known = (*SYSTEMS, *(system for system in between_hosts if system not in SYSTEMS))
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {', '.join(unknown)}; choose from {', '.join(known)}")
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds per cell: checks the harness (CI)")
    parser.add_argument("--sizes", type=_counts, default=None, help="only these model sizes, e.g. 100K,1M")
    parser.add_argument("--clients", type=_counts, default=None, help="only these client counts, e.g. 1,8")
    parser.add_argument(
        "--systems", type=_systems, default=None, help=f"only these systems (comma-separated): {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for results.json and tables")
    parser.add_argument("--figure", type=Path, default=None, help="write the plot here (default OUT/performance.png)")
    parser.add_argument("--report-only", action="store_true", help="rebuild tables and figure from OUT/results.json")
    parser.add_argument(
        "--link",
        type=link_rate,
        default=None,
        metavar="RATE",
        help="between simulated hosts instead (root): each partition's host on a link of RATE (e.g. 1gbit); "
        f"systems {', '.join(cross_host.SYSTEMS)} (and, asked for, {', '.join(cross_host.OPTIONAL_SYSTEMS)}); "
        "writes OUT/cross-host.json and OUT/cross-host.md",
    )
    parser.add_argument(
        "--partitions", type=_counts, default=None, help="with --link: gemps' partition counts (default 1,2,4)"
    )
    parser.add_argument(
        "--replicas",
        type=_counts,
        default=None,
        metavar="R,R",
        help="the cost of replication instead: gemps with these replica counts (e.g. 1,2), fresh servers each run, "
        "alternating, over loopback or, with --link, each replica on a host of its own; writes "
        "OUT/replicas-MODE.json and .md",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="with --replicas: runs of each replica count (default 4)"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="with --replicas: every server and client on mutual TLS (certificates made for the run), the "
        "replication stream inside it too; writes OUT/replicas-MODE-tls.json",
    )
    parser.add_argument(
        "--failover",
        action="store_true",
        help="how long a replicated partition takes to fail over instead: two replicas over loopback, one worker, "
        "the primary killed, then started again (default sizes 1M,10M,100M; --quick: 100K); writes "
        "OUT/failover.json and .md",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --replicas: after each size, one more run of the largest R with py-spy on every replica "
        "(raw samples to DIR; not counted in the figures)",
    )
    parser.set_defaults(run=run)


def link_rate(text: str) -> str:
    """argparse's type for a tc link rate (100mbit, 1gbit): the text, checked."""
    try:
        rate_bits_per_second(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def run(args: argparse.Namespace) -> int:
    if args.failover:
        return _run_failover(args)
    if args.replicas is not None:
        return _run_replicas(args)
    if args.link is not None:
        return _run_cross_host(args)
    if args.report_only:
        return run_bench(args.out, None, args.figure)
    try:
        spec = select(QUICK if args.quick else FULL, args.sizes, args.clients, args.systems)
    except ValueError as error:
        print(f"gemps bench: {error}", file=sys.stderr)
        return 2
    return run_bench(args.out, spec, args.figure)


def _run_cross_host(args: argparse.Namespace) -> int:
    if args.report_only:
        return run_cross_host_bench(args.out, None)
    defaults = cross_host.CrossHostSpec()
    chosen = {
        "sizes": tuple(args.sizes or (QUICK.sizes[-1:] if args.quick else defaults.sizes)),
        "clients": tuple(args.clients or (QUICK.clients[-1:] if args.quick else defaults.clients)),
        "partitions": tuple(args.partitions or defaults.partitions),
        "systems": tuple(args.systems or defaults.systems),
    }
    reason = unavailable_reason()
    try:
        spec = cross_host.CrossHostSpec(args.link, quick=args.quick, **chosen)
        if reason is not None:
            raise ValueError(reason)
    except ValueError as error:
        print(f"gemps bench --link: {error}", file=sys.stderr)
        return 2
    return run_cross_host_bench(args.out, spec)


def _run_replicas(args: argparse.Namespace) -> int:
    defaults = replicas.ReplicasSpec()
    if args.report_only:
        return run_replicas_bench(
            args.out, None, replicas.ReplicasSpec(link=args.link, quick=args.quick, tls=args.tls).mode
        )
    try:
        spec = replicas.ReplicasSpec(
            replicas=tuple(args.replicas),
            sizes=tuple(args.sizes or (QUICK.sizes[-1:] if args.quick else defaults.sizes)),
            clients=(args.clients or [QUICK.clients[-1] if args.quick else defaults.clients])[0],
            repeats=args.repeats or (1 if args.quick else defaults.repeats),
            link=args.link,
            quick=args.quick,
            tls=args.tls,
            profile=args.profile,
        )
        reason = unavailable_reason() if args.link is not None else None
        if reason is not None:
            raise ValueError(reason)
    except ValueError as error:
        print(f"gemps bench --replicas: {error}", file=sys.stderr)
        return 2
    return run_replicas_bench(args.out, spec)


def _run_failover(args: argparse.Namespace) -> int:
    if args.report_only:
        return run_failover_bench(args.out, None)
    try:
        spec = failover.FailoverSpec(tuple(args.sizes or ((100_000,) if args.quick else failover.FailoverSpec().sizes)))
    except ValueError as error:
        print(f"gemps bench --failover: {error}", file=sys.stderr)
        return 2
    return run_failover_bench(args.out, spec)
